// See dequantize.h. Each row's groups: the values unpacked 32 at a time, times the
// group's scale plus its bias (one FMA per 8), rows split with OpenMP.
#include "dequantize.h"

#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "qmatvec.h"
#include "simd.h"
#include "unpack.h"

namespace justfit {

namespace {

template <int Bits, typename S>
void dequantize_rows(const uint8_t* w, const S* scales, const S* biases, float* y, int64_t rows, int in,
                     int group_size) {
  const int groups = in / group_size;
  const int64_t row_bytes = static_cast<int64_t>(in) * Bits / 8;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    float* yr = y + r * in;
    for (int g = 0; g < groups; ++g) {
      const float scale = widen(scales, r * groups + g), bias = widen(biases, r * groups + g);
      const int base = g * group_size;
#ifdef __AVX2__
      const __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(bias);
      for (int c = 0; c < group_size; c += 32) {
        __m256 q[4];
        floats32<Bits>(wr + static_cast<int64_t>(base + c) * Bits / 8, q);
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(yr + base + c + 8 * k, _mm256_fmadd_ps(q[k], s, b));
      }
#else
      unpack_group<Bits>(wr + static_cast<int64_t>(base) * Bits / 8, yr + base, group_size);
      for (int j = 0; j < group_size; ++j) yr[base + j] = yr[base + j] * scale + bias;
#endif
    }
  }
}

}  // namespace

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     mx::StreamOrDevice s) {
  if (!matvec_width(bits)) throw std::invalid_argument("dequantize: bits must be 4, 5, 6 or 8");
  if (group_size % 32 != 0) throw std::invalid_argument("dequantize: group_size must be a multiple of 32");
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    throw std::invalid_argument("dequantize: scales and biases must both be float16 or both float32");
  if (w.dtype() != mx::uint32 || w.ndim() < 1 || scales.shape() != biases.shape() || scales.ndim() != w.ndim())
    throw std::invalid_argument("dequantize: w must be uint32, scales and biases of its rank and one shape");
  auto shape = w.shape();
  shape.back() = w.shape(-1) * 32 / bits;
  for (int d = 0; d + 1 < w.ndim(); ++d)
    if (scales.shape(d) != w.shape(d)) throw std::invalid_argument("dequantize: shapes do not agree");
  if (scales.shape(-1) * group_size != shape.back()) throw std::invalid_argument("dequantize: shapes do not agree");
  return mx::array(shape, mx::float32, std::make_shared<Dequantize>(mx::to_stream(s), group_size, bits),
                   {w, scales, biases});
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  const int in = y.shape(-1), bits = bits_, group_size = group_size_;
  const bool half = inputs[1].dtype() == mx::float16;
  encoder.dispatch([w = RowMajor{inputs[0]}, sc = RowMajor{inputs[1]}, bi = RowMajor{inputs[2]}, yp = y.data<float>(),
                    rows = static_cast<int64_t>(y.size() / in), in, bits, group_size, half]() mutable {
    const uint8_t* wp = w.data<uint8_t>();
    with_stored<4, 5, 6, 8>(bits, half, sc.data<uint8_t>(), bi.data<uint8_t>(), [&]<int B>(auto* s, auto* b) {
      dequantize_rows<B>(wp, s, b, yp, rows, in, group_size);
    });
  });
}

}  // namespace justfit

// See qmatmul_rows.h. Per leading index and per slice of the N columns: each row k of W
// is widened group by group and added, times x[m, k] * scale, into the M output rows;
// the biases' share, x[m, k] * bias summed over k, is added once per group at the end.
// Work is split over (leading index, column slice) pairs with OpenMP.
#include "qmatmul_rows.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "stored.h"

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace justfit {

namespace {

inline float widen(const mx::float16_t* p, size_t i) {
#ifdef __F16C__
  return _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[i]);
#else
  return static_cast<float>(p[i]);
#endif
}
inline float widen(const float* p, size_t i) { return p[i]; }

template <int Bits>
inline float value(const uint8_t* row, int j) {
  if constexpr (Bits == 8) return static_cast<float>(row[j]);
  return static_cast<float>((row[j >> 1] >> ((j & 1) * 4)) & 15);
}

constexpr int kSlice = 512;  // output columns per task: a multiple of every group size used

template <int Bits, typename S>
void rows_product(const float* x, const uint8_t* w, const S* scales, const S* biases, float* y, int batch, int M,
                  int K, int N, int group_size) {
  const int groups = N / group_size;
  const int row_bytes = N * Bits / 8;
  const int slice = std::max(group_size, kSlice / group_size * group_size);
  const int slices = (N + slice - 1) / slice;
#pragma omp parallel for schedule(static) collapse(2)
  for (int b = 0; b < batch; ++b) {
    for (int sl = 0; sl < slices; ++sl) {
      const int n0 = sl * slice, n1 = std::min(N, n0 + slice), g0 = n0 / group_size, g1 = n1 / group_size;
      const float* xb = x + static_cast<size_t>(b) * M * K;
      const uint8_t* wb = w + static_cast<size_t>(b) * K * row_bytes;
      const S* sb = scales + static_cast<size_t>(b) * K * groups;
      const S* bb = biases + static_cast<size_t>(b) * K * groups;
      float* yb = y + static_cast<size_t>(b) * M * N;
      std::vector<float> acc(static_cast<size_t>(M) * (n1 - n0), 0.f), bias(static_cast<size_t>(M) * (g1 - g0), 0.f);
      std::vector<float> widened(n1 - n0);
      for (int k = 0; k < K; ++k) {
        const uint8_t* wrow = wb + static_cast<size_t>(k) * row_bytes;
        for (int n = n0; n < n1; ++n) widened[n - n0] = value<Bits>(wrow, n);
        for (int m = 0; m < M; ++m) {
          const float xm = xb[static_cast<size_t>(m) * K + k];
          if (xm == 0.f) continue;  // masked probabilities, padding
          float* am = acc.data() + static_cast<size_t>(m) * (n1 - n0);
          for (int g = g0; g < g1; ++g) {
            const float a = xm * widen(sb, static_cast<size_t>(k) * groups + g);
            const float* q = widened.data() + (g - g0) * group_size;
            float* out = am + (g - g0) * group_size;
#pragma omp simd
            for (int j = 0; j < group_size; ++j) out[j] += a * q[j];
            bias[static_cast<size_t>(m) * (g1 - g0) + (g - g0)] += xm * widen(bb, static_cast<size_t>(k) * groups + g);
          }
        }
      }
      for (int m = 0; m < M; ++m)
        for (int n = n0; n < n1; ++n)
          yb[static_cast<size_t>(m) * N + n] =
              acc[static_cast<size_t>(m) * (n1 - n0) + (n - n0)] + bias[static_cast<size_t>(m) * (g1 - g0) + (n / group_size - g0)];
    }
  }
}

}  // namespace

mx::array quantized_matmul_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_matmul_rows: bits must be 4 or 8");
  if (group_size % 8 != 0 || group_size <= 0)
    throw std::invalid_argument("quantized_matmul_rows: group_size must be a positive multiple of 8");
  if (x.dtype() != mx::float32 || w.dtype() != mx::uint32)
    throw std::invalid_argument("quantized_matmul_rows: x must be float32 and w uint32");
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    throw std::invalid_argument("quantized_matmul_rows: scales and biases must both be float16 or both float32");
  const int nd = x.ndim();
  if (nd < 2 || w.ndim() != nd || scales.ndim() != nd || biases.shape() != scales.shape())
    throw std::invalid_argument("quantized_matmul_rows: x, w, scales and biases need the same number of dimensions");
  const int K = x.shape(-1), N = w.shape(-1) * 32 / bits;
  if (w.shape(-2) != K || scales.shape(-2) != K || scales.shape(-1) != N / group_size || N % group_size != 0)
    throw std::invalid_argument("quantized_matmul_rows: shapes do not agree");
  for (int d = 0; d < nd - 2; ++d)
    if (w.shape(d) != x.shape(d) || scales.shape(d) != x.shape(d))
      throw std::invalid_argument("quantized_matmul_rows: leading dimensions must be equal");
  auto shape = x.shape();
  shape.back() = N;
  auto stream = mx::to_stream(s);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatmulRows>(stream, group_size, bits),
                   {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream),
                    mx::contiguous(scales, false, stream), mx::contiguous(biases, false, stream)});
}

void QuantizedMatmulRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& scales = inputs[2];
  auto& biases = inputs[3];
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  const int K = x.shape(-1), M = x.shape(-2), N = y.shape(-1), batch = x.size() / (static_cast<size_t>(M) * K);
  const float* xp = x.data<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  float* yp = y.data<float>();
  const int gs = group_size_, bits = bits_;
  const bool half = scales.dtype() == mx::float16;
  encoder.dispatch([=, sp = scales.data<uint8_t>(), bp = biases.data<uint8_t>()]() {
    with_stored(bits, half, sp, bp, [&]<int B>(auto* s, auto* b) { rows_product<B>(xp, wp, s, b, yp, batch, M, K, N, gs); });
  });
}

}  // namespace justfit

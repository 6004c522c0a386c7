// See qmatvec.h. Each output column o reads its weight row once and forms the dot
// product with every input row (at most kRows at a time, so their partial sums stay in
// registers): the weights cost the same for 1 row as for 8. Rows of the output are
// split across threads (OpenMP), which MLX's CPU stream thread runs.
#include "qmatvec.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace justfit {

namespace {

constexpr int kRows = 8;

template <int Bits>
inline void unpack_group(const uint8_t* src, float* dst, int group_size) {
#ifdef __AVX2__
  if constexpr (Bits == 4) {  // 16 bytes -> 32 values in order, 8 floats per conversion
    const __m128i mask = _mm_set1_epi8(15);
    for (int k = 0; k < group_size / 2; k += 16) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
      float* d = dst + 2 * k;
      _mm256_storeu_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)));
      _mm256_storeu_ps(d + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))));
      _mm256_storeu_ps(d + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
      _mm256_storeu_ps(d + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
    }
    return;
  } else {
    for (int j = 0; j < group_size; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j)))));
    return;
  }
#endif
  if constexpr (Bits == 8) {
    for (int j = 0; j < group_size; ++j) dst[j] = static_cast<float>(src[j]);
  } else {  // 4 bits: value 2k is byte k's low nibble, 2k + 1 its high one
    for (int k = 0; k < group_size / 2; ++k) {
      dst[2 * k] = static_cast<float>(src[k] & 15);
      dst[2 * k + 1] = static_cast<float>(src[k] >> 4);
    }
  }
}

// S: the scales' and biases' type as stored (float16 from GGUF and mlx-lm, or float32).
template <int Bits, typename S>
void matvec(const float* x, const uint8_t* w, const S* scales, const S* biases, float* y,
            int rows, int in, int out, int group_size) {
  const int groups = in / group_size;
  const int row_bytes = in * Bits / 8;
  std::vector<float> sums(static_cast<size_t>(rows) * groups);  // sum of x over each group
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int j = 0; j < group_size; ++j) s += x[r * in + g * group_size + j];
      sums[r * groups + g] = s;
    }
  const float* xsum = sums.data();
#pragma omp parallel for schedule(static)
  for (int o = 0; o < out; ++o) {
    alignas(32) float q[256];
    const uint8_t* wrow = w + static_cast<size_t>(o) * row_bytes;
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      const int nr = rows - r0 < kRows ? rows - r0 : kRows;
      float acc[kRows] = {0.f};
      for (int g = 0; g < groups; ++g) {
        unpack_group<Bits>(wrow + g * group_size * Bits / 8, q, group_size);
        const float sc = static_cast<float>(scales[static_cast<size_t>(o) * groups + g]);
        const float bi = static_cast<float>(biases[static_cast<size_t>(o) * groups + g]);
        for (int r = 0; r < nr; ++r) {
          const float* xr = x + static_cast<size_t>(r0 + r) * in + g * group_size;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int j = 0; j < group_size; ++j) dot += q[j] * xr[j];
          acc[r] += sc * dot + bi * xsum[(r0 + r) * groups + g];
        }
      }
      for (int r = 0; r < nr; ++r) y[static_cast<size_t>(r0 + r) * out + o] = acc[r];
    }
  }
}

}  // namespace

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_matvec: bits must be 4 or 8");
  if (group_size % 32 != 0 || group_size > 256)
    throw std::invalid_argument("quantized_matvec: group_size must be a multiple of 32, at most 256");
  if (x.dtype() != mx::float32)
    throw std::invalid_argument("quantized_matvec: x must be float32");
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    throw std::invalid_argument("quantized_matvec: scales and biases must both be float16 or both float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || scales.ndim() != 2)
    throw std::invalid_argument("quantized_matvec: w must be a 2-D uint32 array");
  int out = w.shape(0), in = w.shape(1) * 32 / bits;
  if (x.shape(-1) != in || scales.shape(0) != out || scales.shape(1) != in / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("quantized_matvec: shapes do not agree");
  auto shape = x.shape();
  shape.back() = out;
  auto stream = mx::to_stream(s);
  auto inputs = std::vector<mx::array>{mx::contiguous(x, false, stream), mx::contiguous(w, false, stream),
                                       mx::contiguous(scales, false, stream), mx::contiguous(biases, false, stream)};
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatvec>(stream, group_size, bits), inputs);
}

void QuantizedMatvec::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& scales = inputs[2];
  auto& biases = inputs[3];
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  encoder.set_output_array(y);
  int out = w.shape(0), in = x.shape(-1), rows = x.size() / in;
  const float* xp = x.data<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  float* yp = y.data<float>();
  int gs = group_size_, bits = bits_;
  if (scales.dtype() == mx::float16) {
    encoder.dispatch([=, sp = scales.data<mx::float16_t>(), bp = biases.data<mx::float16_t>()]() {
      if (bits == 4)
        matvec<4>(xp, wp, sp, bp, yp, rows, in, out, gs);
      else
        matvec<8>(xp, wp, sp, bp, yp, rows, in, out, gs);
    });
  } else {
    encoder.dispatch([=, sp = scales.data<float>(), bp = biases.data<float>()]() {
      if (bits == 4)
        matvec<4>(xp, wp, sp, bp, yp, rows, in, out, gs);
      else
        matvec<8>(xp, wp, sp, bp, yp, rows, in, out, gs);
    });
  }
}

void QuantizedMatvec::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFit's quantized_matvec runs on the CPU only (on Metal, MLX's own is used)");
}

bool QuantizedMatvec::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatvec&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

}  // namespace justfit

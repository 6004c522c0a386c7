// Helpers the native kernels share: scales and biases as stored (float16 or float32)
// read as floats; with AVX2, horizontal sums and the biases' share of a column's product.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mlx/types/half_types.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace justfit {

// A scale or bias as float: float16 through F16C where the build has it (MLX's x86
// float16_t converts in software, a dozen instructions each), float32 as is.
inline float widen(const mlx::core::float16_t* p, size_t i) {
#ifdef __F16C__
  return _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[i]);
#else
  return static_cast<float>(p[i]);
#endif
}
inline float widen(const float* p, size_t i) { return p[i]; }

// A matvec's output columns ahead whose weights, scales and biases are requested while
// the current one computes: the hardware prefetcher alone kept a large matrix (Gemma 3's
// 262,144-row tied head) well below a plain streaming read.
constexpr int kColumnsAhead = 8;

// Requests the bytes of the column kColumnsAhead after the one at (w, sc, bi).
template <typename S>
inline void prefetch_column(const uint8_t* w, int row_bytes, const S* sc, const S* bi, int groups) {
  const uint8_t* wa = w + static_cast<size_t>(kColumnsAhead) * row_bytes;
  for (int at = 0; at < row_bytes; at += 64) __builtin_prefetch(wa + at);
  const int s_bytes = groups * static_cast<int>(sizeof(S));
  const char* sa = reinterpret_cast<const char*>(sc + static_cast<size_t>(kColumnsAhead) * groups);
  const char* ba = reinterpret_cast<const char*>(bi + static_cast<size_t>(kColumnsAhead) * groups);
  for (int at = 0; at < s_bytes; at += 64) {
    __builtin_prefetch(sa + at);
    __builtin_prefetch(ba + at);
  }
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A vector's lanes summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the order
// in which the kernels that reduce four or eight vectors at once (hadd pairs) sum each,
// so a column or key computed alone gives the same bits as one computed with others.
inline float hsum_pairs(__m256 v) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v, v), v);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// 8 scales or biases as floats (float16 through F16C).
inline __m256 widen8(const mlx::core::float16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

// sum over groups g of (biases[g] + offset * scales[g]) * xsum[g]: the biases' share of a
// column's product (offset 128 for 8-bit weights taken as w - 128), 8 groups at a time.
template <typename S>
inline float bias_share(const S* bi, const S* sc, float offset, const float* xsum, int groups) {
  __m256 acc = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256 o = widen8(bi + g);
    if (offset != 0.f) o = _mm256_fmadd_ps(widen8(sc + g), _mm256_set1_ps(offset), o);
    acc = _mm256_fmadd_ps(o, _mm256_loadu_ps(xsum + g), acc);
  }
  float tail = 0.f;
  for (; g < groups; ++g) tail += (widen(bi, g) + offset * widen(sc, g)) * xsum[g];
  return hsum(acc) + tail;
}

// A column's scales as floats into `out` (8 at a time).
template <typename S>
inline void widen_scales(const S* sc, int groups, float* out) {
  int g = 0;
  for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(out + g, widen8(sc + g));
  for (; g < groups; ++g) out[g] = widen(sc, g);
}

// exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, a degree-6
// polynomial, the exponent put back in the float's bits; within 2 ulp of the libm value);
// under -87.3 (and -inf) it is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n: n >= -126 after the clamp, a normal float; what lies below the clamp is 0
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
}

#endif

}  // namespace justfit

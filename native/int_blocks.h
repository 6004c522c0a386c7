// The blocks of the rounded-activation product (qmatvec_int.cpp): x's blocks of 32
// rounded to int8 or int16, a block of weights unpacked once for every row, the integer
// dot products and their scaling, for one column or four at a time. AVX2 only.
#pragma once

#ifdef __AVX2__
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lines.h"
#include "simd.h"
#include "stored.h"
#include "unpack.h"

namespace justfit::int_blocks {

constexpr int kRows = 4;  // rows per pass over a column (registers: weights, a row's block)

// Each row's blocks of 32 rounded to T at their largest magnitude / Max; for 4-bit weights
// a block's values are stored evens first, then odds: the order its nibbles unpack in.
template <typename T>
struct Rounded {
  Lines<T> q;       // [rows, in]
  Lines<float> d;   // [rows, in / 32]: a block's scale
  Lines<float> sum; // [rows, groups]: the rounded values' sum over the group (q x d)
};

template <typename T>
Rounded<T> rounded(const float* x, int rows, int in, int group_size, int bits) {
  constexpr float kMax = sizeof(T) == 1 ? 127.f : 32767.f;
  const int blocks = in / 32, groups = in / group_size, per_group = group_size / 32;
  Rounded<T> a{Lines<T>(static_cast<size_t>(rows) * in), Lines<float>(static_cast<size_t>(rows) * blocks),
               Lines<float>(static_cast<size_t>(rows) * groups, 0.f)};
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b) {
      const float* xb = x + static_cast<size_t>(r) * in + b * 32;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / kMax, id = amax > 0.f ? kMax / amax : 0.f;
      T* qb = a.q.data() + static_cast<size_t>(r) * in + b * 32;
      long sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));
        sum += v;
        qb[bits == 4 ? (j % 2) * 16 + j / 2 : j] = static_cast<T>(v);
      }
      a.d[static_cast<size_t>(r) * blocks + b] = d;
      a.sum[static_cast<size_t>(r) * groups + b / per_group] += static_cast<float>(sum) * d;
    }
  return a;
}

// 32 weights as unsigned bytes: 4-bit as the nibbles (evens, then odds), 8-bit as stored,
// 5- and 6-bit in order.
template <int Bits>
inline __m256i weights32(const uint8_t* src) {
  if constexpr (Bits == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
  } else if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  } else {
    return bytes32<Bits>(src);
  }
}

// A block's weights as the dot product takes them, unpacked once for every row: bytes for
// int8 activations, 16-bit lanes for int16 (values 0-15 of the bytes' order, then 16-31).
template <typename T>
struct Unpacked {
  __m256i lo, hi;
};

template <int Bits, typename T>
inline Unpacked<T> unpack(const uint8_t* src) {
  if constexpr (sizeof(T) == 1) {
    return {weights32<Bits>(src), __m256i{}};
  } else if constexpr (streamed_width(Bits)) {
    Unpacked<T> u;
    words32<Bits>(src, u.lo, u.hi);
    return u;
  } else if constexpr (Bits == 4) {  // each byte widened, then its two nibbles: evens, odds
    const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return {_mm256_and_si256(b16, _mm256_set1_epi16(15)), _mm256_srli_epi16(b16, 4)};
  } else {
    const __m256i w = weights32<Bits>(src);
    return {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1))};
  }
}

// A block's integer dot product as 8 int32 lanes. int8: maddubs (unsigned x signed bytes,
// pairs to 16 bits); 8-bit weights go as |w - 128| with q carrying w - 128's sign, so no
// pair overflows, and the offset's 128 x sum(q) comes back through the biases' share
// (below 8 bits no pair can: 2 x 63 x 127 < 2^15). int16: madd (pairs to 32 bits).
template <typename T>
struct XBlock {  // a row's rounded block: 32 bytes, or 32 16-bit values in two vectors
  __m256i a, b;
};

template <typename T>
inline XBlock<T> load_x(const T* q) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  if constexpr (sizeof(T) == 1)
    return {a, a};
  else
    return {a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))};
}

template <int Bits, typename T>
inline __m256i block_dot(const Unpacked<T>& w, const XBlock<T>& xb) {
  if constexpr (sizeof(T) == 1) {
    __m256i x = xb.a;
    __m256i u = w.lo;
    if constexpr (Bits == 8) {
      const __m256i centred = _mm256_xor_si256(w.lo, _mm256_set1_epi8(-128));
      u = _mm256_abs_epi8(centred);
      x = _mm256_sign_epi8(x, centred);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
  } else {
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, xb.a), _mm256_madd_epi16(w.hi, xb.b));
  }
}

// d x the group's scale for each of a row's blocks into `cs`.
template <typename S>
inline void scale_blocks(const float* d, const S* sc, int groups, int per_group, float* cs) {
  int g = 0;
  if (per_group == 1)  // groups of 32 (a GGUF's Q4_0/Q4_1/Q8_0): 8 blocks at a time
    for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(cs + g, _mm256_mul_ps(_mm256_loadu_ps(d + g), widen8(sc + g)));
  for (; g < groups; ++g) {
    const float scale = widen(sc, g);
    for (int j = 0; j < per_group; ++j) cs[g * per_group + j] = d[g * per_group + j] * scale;
  }
}

// The sums of four vectors' lanes, [a0, a1, a2, a3]: each ((l0 + l1) + (l2 + l3)) +
// ((l4 + l5) + (l6 + l7)), the order `hsum_pairs` (simd.h) adds one vector's lanes in.
inline __m128 hsum4(const __m256 a[4]) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Four consecutive output columns for one input row (decode): each block of x is loaded
// once for the four and their sums reduced together, which halves what a column costs
// outside its blocks (a 576-wide SmolLM2 row has 18).
template <int Bits, typename T, typename S>
inline void four_columns(const T* xq, const float* xd, const float* xsum, int in, const uint8_t* wrow, int row_bytes,
                         const S* sc, const S* bi, int groups, int group_size, float* y, Lines<float>& scaled) {
  const int blocks = in / 32;
  if (scaled.size() < static_cast<size_t>(4) * blocks) scaled.resize(static_cast<size_t>(4) * blocks);
  for (int c = 0; c < 4; ++c) scale_blocks(xd, sc + c * groups, groups, group_size / 32, scaled.data() + c * blocks);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < blocks; ++b) {
    const XBlock<T> xb = load_x<T>(xq + b * 32);
    for (int c = 0; c < 4; ++c) {
      const Unpacked<T> w = unpack<Bits, T>(wrow + static_cast<size_t>(c) * row_bytes + static_cast<size_t>(b) * 32 * Bits / 8);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot<Bits, T>(w, xb)),
                               _mm256_broadcast_ss(scaled.data() + c * blocks + b), acc[c]);
    }
  }
  alignas(16) float sums[4];
  _mm_store_ps(sums, hsum4(acc));
  const float offset = sizeof(T) == 1 && Bits == 8 ? 128.f : 0.f;
  for (int c = 0; c < 4; ++c) y[c] = sums[c] + bias_share(bi + c * groups, sc + c * groups, offset, xsum, groups);
}

// Columns o .. o + 3 of a weight with `out` columns (its rows, scales and biases from
// their starts) for one input row, those kColumnsAhead later requested first.
template <int Bits, typename T, typename S>
inline void four_columns_at(const Rounded<T>& a, int in, const uint8_t* w, const S* scales, const S* biases,
                            int groups, int group_size, int o, int out, float* y, Lines<float>& scaled) {
  const int row_bytes = in * Bits / 8;
  const uint8_t* wrow = w + static_cast<size_t>(o) * row_bytes;
  const S* sc = scales + static_cast<size_t>(o) * groups;
  const S* bi = biases + static_cast<size_t>(o) * groups;
  for (int c = 0; c < 4; ++c)
    if (o + c + kColumnsAhead < out)
      prefetch_column(wrow + c * row_bytes, row_bytes, sc + c * groups, bi + c * groups, groups);
  four_columns<Bits>(a.q.data(), a.d.data(), a.sum.data(), in, wrow, row_bytes, sc, bi, groups, group_size, y + o,
                     scaled);
}

// Output column `o` for NR rows; `scaled` is per-thread room for each row's d x scale per block.
// Every row adds its blocks in one chain, in `four_columns`' order, whatever NR is: a
// row's product does not depend on how many rows share the call (a prefill chunk, a
// batched or verifying decode step and a lone decode step give the same bits).
template <int Bits, int NR, typename T, typename S>
inline void column(const T* xq, const float* xd, const float* xsum, int in, const uint8_t* wrow, const S* sc,
                   const S* bi, int groups, int group_size, float* y, int out, Lines<float>& scaled) {
  constexpr int ACC = 1;
  const int blocks = in / 32, per_group = group_size / 32;
  if (scaled.size() < static_cast<size_t>(NR) * blocks) scaled.resize(static_cast<size_t>(NR) * blocks);
  for (int r = 0; r < NR; ++r)
    scale_blocks(xd + static_cast<size_t>(r) * blocks, sc, groups, per_group, scaled.data() + static_cast<size_t>(r) * blocks);
  __m256 acc[NR][ACC];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < ACC; ++k) acc[r][k] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const Unpacked<T> w = unpack<Bits, T>(wrow + static_cast<size_t>(b) * 32 * Bits / 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(block_dot<Bits, T>(w, load_x<T>(xq + static_cast<size_t>(r) * in + b * 32)));
      acc[r][b % ACC] = _mm256_fmadd_ps(sums, _mm256_broadcast_ss(scaled.data() + static_cast<size_t>(r) * blocks + b),
                                        acc[r][b % ACC]);
    }
  }
  const float offset = sizeof(T) == 1 && Bits == 8 ? 128.f : 0.f;
  for (int r = 0; r < NR; ++r) {
    __m256 total = acc[r][0];
    for (int k = 1; k < ACC; ++k) total = _mm256_add_ps(total, acc[r][k]);
    y[static_cast<size_t>(r) * out] = hsum_pairs(total) + bias_share(bi, sc, offset, xsum + static_cast<size_t>(r) * groups, groups);
  }
}

}  // namespace justfit::int_blocks
#endif

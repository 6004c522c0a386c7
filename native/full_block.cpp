// See full_block.h. Scores: eight keys at a time, each row's eight dot products kept as
// vectors and their lanes summed together (one reduction for eight keys, not one each);
// threads split the keys. Values: a row's outputs, 32 at a time, stay in registers while
// every value row goes by; threads split the leading indices and the 32-wide spans.
#include "full_block.h"

#include <algorithm>

#include "simd.h"

namespace justfit {

namespace {

constexpr int kKeys = 64;                  // keys a scores task takes
constexpr long kParallel = 1 << 15;        // multiply-adds from which both cores share a block
constexpr int kSpan = 32;                  // a values task's outputs per row
constexpr int kValueRows = 3;              // rows a values pass keeps in registers

template <typename T>
float dot(const float* a, const T* b, int D) {
  float s = 0.f;
  for (int d = 0; d < D; ++d) s += a[d] * widen(b, d);
  return s;
}
float dot(const float* a, const float* b, int D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

#ifdef __AVX2__
// [sum of a[0]'s lanes, ..., sum of a[7]'s].
inline __m256 lane_sums(const __m256 a[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // each holds its four vectors' low-half sums, then their high-half sums
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// MR query rows' 32 outputs from d0 in registers while every value row goes by once
// for all of them (each row's sum over t in the same order as alone).
template <int MR, typename T>
void value_rows(const float* p, int ld, const T* vb, int64_t row, int n, int d0, float* out, int D) {
  __m256 a[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) a[m][j] = _mm256_loadu_ps(out + static_cast<size_t>(m) * D + d0 + 8 * j);
  for (int t = 0; t < n; ++t) {
    const T* vt = vb + t * row + d0;
    __m256 pt[MR];  // 12 sums, 3 weights and a value vector: the 16 registers
    for (int m = 0; m < MR; ++m) pt[m] = _mm256_broadcast_ss(p + static_cast<size_t>(m) * ld + t);
    for (int j = 0; j < 4; ++j) {
      const __m256 vj = widen8(vt + 8 * j);
      for (int m = 0; m < MR; ++m) a[m][j] = _mm256_fmadd_ps(pt[m], vj, a[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + static_cast<size_t>(m) * D + d0 + 8 * j, a[m][j]);
}
#endif

}  // namespace

template <typename T>
void full_scores(const float* q, const FullRows<T>& k, int batch, int R, int D, int n, float* s, int ld) {
  const int tasks = (n + kKeys - 1) / kKeys;
#pragma omp parallel for schedule(static) collapse(2) if (static_cast<long>(batch) * R * n * D >= kParallel)
  for (int b = 0; b < batch; ++b)
    for (int task = 0; task < tasks; ++task) {
      const T* kb = k.data + static_cast<int64_t>(b) * k.batch;
      const int t1 = std::min(n, (task + 1) * kKeys);
      for (int i = b * R; i < (b + 1) * R; ++i) {
        const float* qi = q + static_cast<size_t>(i) * D;
        float* si = s + static_cast<size_t>(i) * ld;
        int t = task * kKeys;
#ifdef __AVX2__
        if (D % 8 == 0)
          for (; t + 8 <= t1; t += 8) {
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
              const __m256 qv = _mm256_loadu_ps(qi + d);
              for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, widen8(kb + (t + j) * k.row + d), acc[j]);
            }
            _mm256_storeu_ps(si + t, lane_sums(acc));
          }
        if (D % 8 == 0)  // the last keys as in a group of eight: a key's score does not depend on the block's length
          for (; t < t1; ++t) {
            __m256 acc = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), widen8(kb + t * k.row + d), acc);
            si[t] = hsum_pairs(acc);
          }
#endif
        for (; t < t1; ++t) si[t] = dot(qi, kb + t * k.row, D);
      }
    }
}

template <typename T>
void full_values(const float* p, const FullRows<T>& v, int batch, int R, int D, int n, int ld, float* acc) {
  const int spans = (D + kSpan - 1) / kSpan;
#pragma omp parallel for schedule(static) collapse(2) if (static_cast<long>(batch) * R * n * D >= kParallel)
  for (int b = 0; b < batch; ++b)
    for (int span = 0; span < spans; ++span) {
      const T* vb = v.data + static_cast<int64_t>(b) * v.batch;
      const int d0 = span * kSpan, d1 = std::min(D, d0 + kSpan);
      int i = b * R;
#ifdef __AVX2__
      if (d1 - d0 == kSpan)
        for (; i < (b + 1) * R; i += kValueRows) {
          const int rows = std::min(kValueRows, (b + 1) * R - i);
          switch (rows) {
            case 1: value_rows<1, T>(p + static_cast<size_t>(i) * ld, ld, vb, v.row, n, d0, acc + static_cast<size_t>(i) * D, D); break;
            case 2: value_rows<2, T>(p + static_cast<size_t>(i) * ld, ld, vb, v.row, n, d0, acc + static_cast<size_t>(i) * D, D); break;
            default: value_rows<3, T>(p + static_cast<size_t>(i) * ld, ld, vb, v.row, n, d0, acc + static_cast<size_t>(i) * D, D); break;
          }
        }
#endif
      for (; i < (b + 1) * R; ++i) {
        const float* pi = p + static_cast<size_t>(i) * ld;
        float* out = acc + static_cast<size_t>(i) * D;
        for (int t = 0; t < n; ++t) {
          const float pt = pi[t];
          const T* vt = vb + t * v.row;
          for (int d = d0; d < d1; ++d) out[d] += pt * widen(vt, d);
        }
      }
    }
}

using mlx::core::float16_t;
template void full_scores<float>(const float*, const FullRows<float>&, int, int, int, int, float*, int);
template void full_scores<float16_t>(const float*, const FullRows<float16_t>&, int, int, int, int, float*, int);
template void full_values<float>(const float*, const FullRows<float>&, int, int, int, int, int, float*);
template void full_values<float16_t>(const float*, const FullRows<float16_t>&, int, int, int, int, int, float*);

}  // namespace justfit

// See page_product.h: the AVX2 path (the portable one is in page_product.cpp). The scale
// folds into x (x[m, k] * scale[k, g], once per group) and the biases' share (x[m, k] *
// bias summed over k) starts each group's sums. Up to 4 rows x 16 columns of the output
// stay in registers while every row of a part of W goes by, 8 values widened at a time.
// Work is split with OpenMP.
#ifdef __AVX2__
#include "page_product.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "stored.h"

namespace justfit {

namespace {

// For 8 values of `Bits` bits: which two source bytes each 32-bit output lane takes (the
// 128-bit halves shuffle separately, so lanes 4-7 index the same bytes again) and by how
// many bits it then shifts right.
template <int Bits>
struct Lanes {
  alignas(32) int8_t picks[32] = {};
  alignas(32) int32_t offsets[8] = {};
  constexpr Lanes() {
    for (int j = 0; j < 8; ++j) {
      const int bit = j * Bits, at = (j % 4) * 4 + (j / 4) * 16;
      picks[at] = static_cast<int8_t>(bit >> 3);
      picks[at + 1] = static_cast<int8_t>((bit >> 3) + 1);
      picks[at + 2] = picks[at + 3] = static_cast<int8_t>(-128);  // a zero byte
      offsets[j] = bit & 7;
    }
  }
};
template <int Bits>
constexpr Lanes<Bits> kLanes{};

// 8 NV consecutive values (n a multiple of 8) of a row as NV vectors of floats: 8 values
// fill `Bits` bytes, so below 8 bits one 16-byte load holds all 16 values of NV = 2 (the
// second 8 pick the bytes `Bits` further on, at the same bit offsets). Past the storage's
// last 16 bytes the bytes are copied out first.
template <int Bits, int NV>
inline void load_values(const uint8_t* row, int n, const uint8_t* end, __m256 v[NV]) {
  const uint8_t* at = row + n / 8 * Bits;
  if constexpr (Bits == 8) {
    for (int j = 0; j < NV; ++j)
      v[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8 * j))));
  } else {
    __m128i bytes;
    if (at + 16 <= end) {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    } else {
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, at, NV * Bits);
      bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    }
    const __m256i all = _mm256_broadcastsi128_si256(bytes);
    const __m256i offset = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLanes<Bits>.offsets));
    const __m256i mask = _mm256_set1_epi32((1 << Bits) - 1);
    __m256i pick = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLanes<Bits>.picks));
    for (int j = 0; j < NV; ++j) {
      // the zero bytes' index (-128) keeps its top bit when Bits is added: still zero
      if (j) pick = _mm256_add_epi8(pick, _mm256_set1_epi8(static_cast<int8_t>(Bits)));
      const __m256i lanes = _mm256_shuffle_epi8(all, pick);
      v[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(lanes, offset), mask));
    }
  }
}

constexpr int kTileRows = 4;  // input rows whose output tiles stay in registers together
constexpr int kAhead = 256;   // columns ahead whose bytes a tile asks for

// One part's rows into the MR x NV*8 output tile at columns [n, n + 8 NV) of group g:
// acc[m] += sum over k of (x[m, column k] * scale[k, g]) * w[k, n..]; the scaled x comes
// precomputed, `xs[k * MR + m]`.
template <int Bits, int MR, int NV>
inline void tile_part(const float* xs, const uint8_t* w, size_t row_bytes, int K, int n, const uint8_t* end,
                      __m256 acc[MR][NV]) {
  for (int k = 0; k < K; ++k) {
    const uint8_t* row = w + k * row_bytes;
    // Keys stored per channel: each of a page's rows is a separate stream (64 for a
    // SmolLM2 head), more than the hardware prefetcher follows, so every new cache line
    // was a demand miss; ask for the line kAhead columns on.
    _mm_prefetch(reinterpret_cast<const char*>(row + static_cast<size_t>(n + kAhead) * Bits / 8), _MM_HINT_T0);
    __m256 v[NV];
    load_values<Bits, NV>(row, n, end, v);
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(xs + static_cast<size_t>(k) * MR + m);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm256_fmadd_ps(a, v[j], acc[m][j]);
    }
  }
}

// Rows m0 .. m0 + MR of y at columns [n0, n1) of one group (a multiple of NV*8 columns)
// for leading index b: x's columns times each row's scale (and the biases' share) once
// for the group, then tile by tile over every row of every part.
template <int MR, int NV, typename S>
void tiles(const float* xb, int D, const std::vector<Part>& parts, int heads, int b, int m0, int N, int group_size,
           int n0, int n1, std::vector<float>& xs, int batch, float* yb, int ldy) {
  const int g = n0 / group_size;
  size_t need = 0;
  for (const Part& part : parts) need += static_cast<size_t>(part.rows) * MR;
  if (xs.size() < need) xs.resize(need);
  float bias[MR] = {};
  float* at = xs.data();
  for (const Part& part : parts) {
    const size_t groups = part.stride / group_size, lead = static_cast<size_t>(b) * part.batch_rows;
    const int32_t* columns = part.columns ? part.columns + static_cast<size_t>(b % heads) * part.rows : nullptr;
    const S* sc = reinterpret_cast<const S*>(part.scales) + lead * groups;
    const S* bi = reinterpret_cast<const S*>(part.biases) + lead * groups;
    for (int k = 0; k < part.rows; ++k, at += MR) {
      const int column = columns ? columns[k] : k;
      const float scale = widen(sc, static_cast<size_t>(k) * groups + g), bk = widen(bi, static_cast<size_t>(k) * groups + g);
      for (int m = 0; m < MR; ++m) {
        const float xm = xb[static_cast<size_t>(m0 + m) * D + column];
        at[m] = xm * scale;
        bias[m] += xm * bk;
      }
    }
  }
  // Part by part over the span's tiles (each part's loop free of the width's dispatch),
  // the tiles of y accumulating in cache between parts.
  const float* part_xs = xs.data();
  for (size_t p = 0; p < parts.size(); ++p) {
    const Part& part = parts[p];
    const size_t row_bytes = static_cast<size_t>(part.stride) * part.bits / 8;
    const uint8_t* w = part.w + static_cast<size_t>(b) * part.batch_rows * row_bytes;
    const uint8_t* end = part.w + (static_cast<size_t>(batch - 1) * part.batch_rows + part.rows - 1) * row_bytes +
                         static_cast<size_t>(N) * part.bits / 8;
    auto pass = [&]<int Bits>() {
      for (int n = n0; n < n1; n += 8 * NV) {
        __m256 acc[MR][NV];
        for (int m = 0; m < MR; ++m)
          for (int j = 0; j < NV; ++j)
            acc[m][j] = p == 0 ? _mm256_set1_ps(bias[m])
                               : _mm256_loadu_ps(yb + static_cast<size_t>(m0 + m) * ldy + n + 8 * j);
        tile_part<Bits, MR, NV>(part_xs, w, row_bytes, part.rows, n, end, acc);
        for (int m = 0; m < MR; ++m)
          for (int j = 0; j < NV; ++j)
            _mm256_storeu_ps(yb + static_cast<size_t>(m0 + m) * ldy + n + 8 * j, acc[m][j]);
      }
    };
    switch (part.bits) {
      case 2: pass.template operator()<2>(); break;
      case 3: pass.template operator()<3>(); break;
      case 4: pass.template operator()<4>(); break;
      case 5: pass.template operator()<5>(); break;
      case 6: pass.template operator()<6>(); break;
      default: pass.template operator()<8>(); break;
    }
    part_xs += static_cast<size_t>(part.rows) * MR;
  }
}

template <int NV, typename S>
void tile_rows(const float* xb, int D, const std::vector<Part>& parts, int heads, int b, int m0, int mr, int N,
               int group_size, int n0, int n1, std::vector<float>& xs, int batch, float* yb, int ldy) {
  switch (mr) {
    case 1: tiles<1, NV, S>(xb, D, parts, heads, b, m0, N, group_size, n0, n1, xs, batch, yb, ldy); break;
    case 2: tiles<2, NV, S>(xb, D, parts, heads, b, m0, N, group_size, n0, n1, xs, batch, yb, ldy); break;
    case 3: tiles<3, NV, S>(xb, D, parts, heads, b, m0, N, group_size, n0, n1, xs, batch, yb, ldy); break;
    default: tiles<4, NV, S>(xb, D, parts, heads, b, m0, N, group_size, n0, n1, xs, batch, yb, ldy); break;
  }
}

// y = sum over parts of x[.., columns] @ dequantize(part). Tasks (OpenMP) are spans of
// one group's columns for one leading index: a group's whole span where there are
// enough tasks for the threads, halved until there are; within a task, up to
// kTileRows x 16 outputs stay in registers over every row of W.
template <typename S>
void product(const float* x, const std::vector<Part>& parts, float* y, int batch, int heads, int M, int D, int N,
             int group_size, int ldy) {
  const int width = group_size % 16 == 0 ? 16 : 8;
  int span = group_size;
  while (span > width && span % (2 * width) == 0 && static_cast<long>(batch) * (N / span) < 4) span /= 2;
  const int spans = N / span;
#pragma omp parallel
  {
    std::vector<float> xs;
#pragma omp for schedule(static) collapse(2)
    for (int b = 0; b < batch; ++b)
      for (int t = 0; t < spans; ++t) {
        const float* xb = x + static_cast<size_t>(b) * M * D;
        float* yb = y + static_cast<size_t>(b) * M * ldy;
        const int n0 = t * span, n1 = n0 + span;
        for (int m0 = 0; m0 < M; m0 += kTileRows) {
          const int mr = std::min(kTileRows, M - m0);
          if (width == 16)
            tile_rows<2, S>(xb, D, parts, heads, b, m0, mr, N, group_size, n0, n1, xs, batch, yb, ldy);
          else
            tile_rows<1, S>(xb, D, parts, heads, b, m0, mr, N, group_size, n0, n1, xs, batch, yb, ldy);
        }
      }
  }
}

}  // namespace

void product(const float* x, const std::vector<Part>& parts, bool half, float* y, int batch, int heads, int M, int D,
             int N, int group_size, int ldy) {
  if (half)
    product<mx::float16_t>(x, parts, y, batch, heads, M, D, N, group_size, ldy);
  else
    product<float>(x, parts, y, batch, heads, M, D, N, group_size, ldy);
}

}  // namespace justfit

#endif  // __AVX2__

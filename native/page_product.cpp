// See page_product.h. The portable product (the AVX2 one is page_product_avx2.cpp): the
// scale folds into x (x[m, k] * scale[k, g], once per group) and the biases' share
// (x[m, k] * bias summed over k) is added once per group at the end; each task widens a
// slice of each row and adds it into each output row in memory. Work is split with
// OpenMP. Also where a stored part can be read in place.
#include "page_product.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "simd.h"
#include "stored.h"

namespace justfit {

#ifndef __AVX2__  // the AVX2 path is page_product_avx2.cpp
namespace {

// Values [n0, n1) of a row as floats (n0 and n1 multiples of 8). MLX packs every width
// as one little-endian bit stream, so 8 values of `Bits` bits fill exactly `Bits` bytes.
template <int Bits>
inline void widen_row(const uint8_t* row, int n0, int n1, float* out) {
  if constexpr (Bits == 8) {
    for (int n = n0; n < n1; ++n) out[n - n0] = static_cast<float>(row[n]);
  } else if constexpr (Bits == 4) {
    for (int n = n0; n < n1; n += 2) {
      out[n - n0] = static_cast<float>(row[n >> 1] & 15);
      out[n - n0 + 1] = static_cast<float>(row[n >> 1] >> 4);
    }
  } else {
    constexpr uint64_t mask = (uint64_t{1} << Bits) - 1;
    for (int n = n0; n < n1; n += 8) {
      uint64_t v = 0;
      std::memcpy(&v, row + n / 8 * Bits, Bits);  // little-endian hosts (x86_64, arm64)
      for (int j = 0; j < 8; ++j) out[n - n0 + j] = static_cast<float>((v >> (j * Bits)) & mask);
    }
  }
}

constexpr int kSlice = 512;  // output columns per task: a multiple of every group size used

// One task's share: rows k of W (K of them, each N values) times x's column
// `columns[k]` (k itself when columns is null) added into acc [M, n1 - n0] and, per
// group, x times the biases into bias [M, groups in the slice].
template <int Bits, typename S>
void accumulate(const float* xb, int D, const int32_t* columns, const uint8_t* wb, const S* sb, const S* bb,
                int M, int K, int stride, int group_size, int n0, int n1, float* acc, float* bias,
                float* widened) {
  const int groups = stride / group_size, row_bytes = stride * Bits / 8, g0 = n0 / group_size, g1 = n1 / group_size;
  for (int k = 0; k < K; ++k) {
    widen_row<Bits>(wb + static_cast<size_t>(k) * row_bytes, n0, n1, widened);
    const int column = columns ? columns[k] : k;
    for (int m = 0; m < M; ++m) {
      const float xm = xb[static_cast<size_t>(m) * D + column];
      if (xm == 0.f) continue;  // masked probabilities, padding
      float* am = acc + static_cast<size_t>(m) * (n1 - n0);
      for (int g = g0; g < g1; ++g) {
        const float a = xm * widen(sb, static_cast<size_t>(k) * groups + g);
        const float* q = widened + (g - g0) * group_size;
        float* out = am + (g - g0) * group_size;
#pragma omp simd
        for (int j = 0; j < group_size; ++j) out[j] += a * q[j];
        bias[static_cast<size_t>(m) * (g1 - g0) + (g - g0)] += xm * widen(bb, static_cast<size_t>(k) * groups + g);
      }
    }
  }
}

}  // namespace

// Per leading index and slice of the N columns (tasks spread with OpenMP).
void product(const float* x, const std::vector<Part>& parts, bool half, float* y, int batch, int heads, int M, int D,
             int N, int group_size, int ldy) {
  const int slice = std::max(group_size, kSlice / group_size * group_size);
  const int slices = (N + slice - 1) / slice;
#pragma omp parallel for schedule(static) collapse(2)
  for (int b = 0; b < batch; ++b) {
    for (int sl = 0; sl < slices; ++sl) {
      const int n0 = sl * slice, n1 = std::min(N, n0 + slice), g0 = n0 / group_size, g1 = n1 / group_size;
      std::vector<float> acc(static_cast<size_t>(M) * (n1 - n0), 0.f), bias(static_cast<size_t>(M) * (g1 - g0), 0.f);
      std::vector<float> widened(n1 - n0);
      for (const Part& part : parts) {
        const size_t row_bytes = static_cast<size_t>(part.stride) * part.bits / 8;
        const size_t lead = static_cast<size_t>(b) * part.batch_rows, groups = part.stride / group_size;
        const int32_t* columns = part.columns ? part.columns + static_cast<size_t>(b % heads) * part.rows : nullptr;
        with_stored<2, 3, 4, 5, 6, 8>(part.bits, half, part.scales, part.biases, [&]<int B>(auto* s, auto* bs) {
          accumulate<B>(x + static_cast<size_t>(b) * M * D, D, columns, part.w + lead * row_bytes, s + lead * groups,
                        bs + lead * groups, M, part.rows, part.stride, group_size, n0, n1, acc.data(), bias.data(),
                        widened.data());
        });
      }
      float* yb = y + static_cast<size_t>(b) * M * ldy;
      for (int m = 0; m < M; ++m)
        for (int n = n0; n < n1; ++n)
          yb[static_cast<size_t>(m) * ldy + n] =
              acc[static_cast<size_t>(m) * (n1 - n0) + (n - n0)] + bias[static_cast<size_t>(m) * (g1 - g0) + (n / group_size - g0)];
    }
  }
}

#endif  // !__AVX2__

std::optional<std::pair<int64_t, int64_t>> in_place_strides(const mx::array& a) {
  const int nd = a.ndim();
  if (nd < 2 || a.strides()[nd - 1] != 1) return std::nullopt;
  const int64_t row = a.strides()[nd - 2];
  if (row < a.shape(-1)) return std::nullopt;
  int64_t batch = static_cast<int64_t>(a.shape(-2)) * row;  // a single leading index: any
  for (int d = nd - 3; d >= 0; --d) {
    if (a.shape(d) == 1) continue;
    const int64_t inner = d == nd - 3 ? batch : 0;
    if (d == nd - 3) {
      batch = a.strides()[d];
      if (batch < inner || batch % row) return std::nullopt;
    } else {
      // the dimensions above the last leading one must step as if flattened with it
      int64_t want = a.strides()[d + 1] * a.shape(d + 1);
      for (int e = d + 1; e < nd - 2 && a.shape(e) == 1; ++e) want = a.strides()[e + 1] * a.shape(e + 1);
      if (a.strides()[d] != want) return std::nullopt;
    }
  }
  return std::make_pair(row, batch);
}

std::optional<Part> stored_part(const mx::array& w, const mx::array& scales, const mx::array& biases, int bits,
                                int group_size, const int32_t* columns) {
  auto ws = in_place_strides(w), ss = in_place_strides(scales), bs = in_place_strides(biases);
  if (!ws || !ss || !bs || ss != bs) return std::nullopt;
  const int64_t stride = ws->first * 32 / bits, batch_rows = ws->second / ws->first;
  if (ss->first * group_size != stride || ss->second != batch_rows * ss->first) return std::nullopt;
  return Part{reinterpret_cast<const uint8_t*>(w.data<uint32_t>()), scales.data<uint8_t>(), biases.data<uint8_t>(),
              bits, w.shape(-2), columns, static_cast<int>(stride), static_cast<int>(batch_rows)};
}

}  // namespace justfit

// See qmatvec_int.h. Per output column, for up to 4 input rows at a time: each block of
// 32 weights is unpacked to bytes once, its integer dot product with every row's rounded
// block summed to 32 bits, then scaled by the block's d times the group's scale in one
// FMA. The biases (and 8-bit weights' offset) meet the rounded blocks' group sums in one
// vector dot product per column: the whole is the product with the rounded x, so its
// error is the weights (centred, biases included) times the rounding, where an exact sum
// there would leave the unsigned values' mean times it.
#include "qmatvec_int.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "int_blocks.h"
#include "simd.h"
#include "stored.h"

namespace justfit {

#ifdef __AVX2__
bool rounded_available() { return true; }

namespace {

using namespace int_blocks;

template <int Bits, typename T, typename S>
void product(const float* x, const uint8_t* w, const S* scales, const S* biases, float* y, int rows, int in, int out,
             int group_size) {
  const int groups = in / group_size, row_bytes = in * Bits / 8, blocks = in / 32;
  const Rounded<T> a = rounded<T>(x, rows, in, group_size, Bits);
  const int fours = rows == 1 ? out / 4 : 0;  // one row: four columns at a time, then the rest
#pragma omp parallel
  {
    Lines<float> scaled;
#pragma omp for schedule(static)
    for (int f = 0; f < fours; ++f)
      four_columns_at<Bits>(a, in, w, scales, biases, groups, group_size, 4 * f, out, y, scaled);
#pragma omp for schedule(static)
    for (int o = 4 * fours; o < out; ++o) {
      const uint8_t* wrow = w + static_cast<size_t>(o) * row_bytes;
      const S* sc = scales + static_cast<size_t>(o) * groups;
      const S* bi = biases + static_cast<size_t>(o) * groups;
      if (o + kColumnsAhead < out) prefetch_column(wrow, row_bytes, sc, bi, groups);
      for (int r0 = 0; r0 < rows; r0 += kRows) {
        const T* q = a.q.data() + static_cast<size_t>(r0) * in;
        const float* d = a.d.data() + static_cast<size_t>(r0) * blocks;
        const float* sum = a.sum.data() + static_cast<size_t>(r0) * groups;
        float* yo = y + static_cast<size_t>(r0) * out + o;
        switch (std::min(kRows, rows - r0)) {
          case 1: column<Bits, 1>(q, d, sum, in, wrow, sc, bi, groups, group_size, yo, out, scaled); break;
          case 2: column<Bits, 2>(q, d, sum, in, wrow, sc, bi, groups, group_size, yo, out, scaled); break;
          case 3: column<Bits, 3>(q, d, sum, in, wrow, sc, bi, groups, group_size, yo, out, scaled); break;
          default: column<Bits, 4>(q, d, sum, in, wrow, sc, bi, groups, group_size, yo, out, scaled); break;
        }
      }
    }
  }
}

// One row's products with several weights (a layer's q, k and v; gate and up) in one
// parallel loop over every weight's groups of four columns: x rounded once per packing
// (4-bit or not), one fork and join where a loop per weight paid each. Each column
// computes as in `product`, bit for bit.
template <typename T, typename S>
void joint_products(const float* x, const std::vector<RoundedProduct>& ps, int in, int group_size) {
  const int groups = in / group_size;
  bool four_bit = false, other = false;
  std::vector<int> first{0};  // each product's first group of four columns in the joint loop
  for (const auto& p : ps) {
    (p.bits == 4 ? four_bit : other) = true;
    first.push_back(first.back() + p.out / 4);
  }
  const Rounded<T> nibbles = four_bit ? rounded<T>(x, 1, in, group_size, 4) : Rounded<T>{};
  const Rounded<T> plain = other ? rounded<T>(x, 1, in, group_size, 8) : Rounded<T>{};
  const int fours = first.back();
#pragma omp parallel
  {
    Lines<float> scaled;
#pragma omp for schedule(static)
    for (int f = 0; f < fours; ++f) {
      int k = 0;
      while (f >= first[k + 1]) ++k;
      const RoundedProduct& p = ps[k];
      const Rounded<T>& a = p.bits == 4 ? nibbles : plain;
      auto go = [&]<int B>() {
        four_columns_at<B>(a, in, p.w, static_cast<const S*>(p.scales), static_cast<const S*>(p.biases), groups,
                           group_size, 4 * (f - first[k]), p.out, p.y, scaled);
      };
      switch (p.bits) {
        case 4: go.template operator()<4>(); break;
        case 5: go.template operator()<5>(); break;
        case 6: go.template operator()<6>(); break;
        default: go.template operator()<8>(); break;
      }
    }
  }
}

}  // namespace

void matvecs_rounded(const float* x, const std::vector<RoundedProduct>& ps, bool half, int rows, int in,
                     int group_size, int activation_bits) {
  bool joint = rows == 1;
  for (const auto& p : ps) joint = joint && p.out % 4 == 0 && (p.bits == 4 || p.bits == 5 || p.bits == 6 || p.bits == 8);
  if (!joint) {
    for (const auto& p : ps)
      matvec_rounded(x, p.w, p.scales, p.biases, half, p.y, rows, in, p.out, group_size, p.bits, activation_bits);
    return;
  }
  using Half = mlx::core::float16_t;
  if (activation_bits == 8)
    half ? joint_products<int8_t, Half>(x, ps, in, group_size) : joint_products<int8_t, float>(x, ps, in, group_size);
  else
    half ? joint_products<int16_t, Half>(x, ps, in, group_size) : joint_products<int16_t, float>(x, ps, in, group_size);
}

void matvec_rounded(const float* x, const uint8_t* w, const void* scales, const void* biases, bool half, float* y,
                    int rows, int in, int out, int group_size, int bits, int activation_bits) {
  with_stored<4, 5, 6, 8>(bits, half, scales, biases, [&]<int B>(auto* s, auto* b) {
    if (activation_bits == 8)
      product<B, int8_t>(x, w, s, b, y, rows, in, out, group_size);
    else
      product<B, int16_t>(x, w, s, b, y, rows, in, out, group_size);
  });
}
#else
bool rounded_available() { return false; }

void matvec_rounded(const float*, const uint8_t*, const void*, const void*, bool, float*, int, int, int, int, int, int) {
  throw std::runtime_error("rounded activations need AVX2: this build computes in float32 only");
}

void matvecs_rounded(const float*, const std::vector<RoundedProduct>&, bool, int, int, int, int) {
  throw std::runtime_error("rounded activations need AVX2: this build computes in float32 only");
}
#endif

}  // namespace justfit

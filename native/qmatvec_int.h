// The native matrix-vector product with rounded activations: each input row's blocks of
// 32 scaled by their largest magnitude and rounded to int8 (as llama.cpp's q8 blocks) or
// int16, then multiplied with the stored weights in integers (AVX2 maddubs / madd).
#pragma once

#include <cstdint>
#include <vector>

namespace justfit {

// Activation widths the rounded product takes; 32 means float32 (not this product).
inline bool rounded_activations(int activation_bits) { return activation_bits == 8 || activation_bits == 16; }

// Whether this build computes rounded activations (AVX2); elsewhere the float32 path runs.
bool rounded_available();

// y = x @ dequantize(w, scales, biases).T with x's blocks rounded to `activation_bits`
// (8 or 16) for MLX's affine `bits`-bit weights (4, 5, 6 or 8; group_size a multiple of 32);
// scales and biases float16 (`half`) or float32. The biases meet the rounded blocks' sums,
// so y is exactly (to float32 summation) the product with the rounded x.
void matvec_rounded(const float* x, const uint8_t* w, const void* scales, const void* biases, bool half, float* y,
                    int rows, int in, int out, int group_size, int bits, int activation_bits);

// One of several products of the same x: the weight, its scales and biases, its output.
struct RoundedProduct {
  const uint8_t* w;
  const void* scales;
  const void* biases;
  float* y;
  int out, bits;
};

// matvec_rounded for each of `products` (same x, in, group_size and scales dtype); one
// row of x runs them as one parallel loop (the same bits as one by one).
void matvecs_rounded(const float* x, const std::vector<RoundedProduct>& products, bool half, int rows, int in,
                     int group_size, int activation_bits);

}  // namespace justfit

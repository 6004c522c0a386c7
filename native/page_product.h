// The product of a few float32 rows with MLX's affine-quantized matrices in the
// untransposed layout (groups along each row of W), which attention over quantized KV
// pages computes at decode: q K (keys stored per channel) and p V (values per token).
// Shared by the page product primitive (qmatmul_rows.cpp) and decode attention
// (decode_attention.cpp). Stored parts are read where they lie: a segment's storage
// holds more tokens than are written, so rows and leading indices have their own strides.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "stored.h"

namespace justfit {

namespace mx = mlx::core;

// A stored part of W: packed rows, their scales and biases, the width, and the columns of x
// its rows meet ([heads, rows] int32, or null: the rows in order). `stride`: values a stored
// row holds (>= the N used), `batch_rows`: stored rows per leading index (>= rows).
struct Part {
  const uint8_t* w;
  const uint8_t* scales;
  const uint8_t* biases;
  int bits, rows;
  const int32_t* columns;
  int stride, batch_rows;
};

// y[b, m, n] (row stride ldy) = sum over parts of x[b, m, columns] @ dequantize(part)[:, n]
// for x [batch, M, D] (rows of D floats), n < N; N and the column spans multiples of
// group_size. `heads` is the leading index's period for the parts' columns.
void product(const float* x, const std::vector<Part>& parts, bool half, float* y, int batch, int heads, int M, int D,
             int N, int group_size, int ldy);

// The row and leading-index strides (in elements) of `a` [..., rows, n] where it can be read
// in place: unit-strided rows, leading dimensions that flatten to one stride. Else none.
std::optional<std::pair<int64_t, int64_t>> in_place_strides(const mx::array& a);

// `w`, `scales` and `biases` (MLX's transpose=False layout, `rows` rows of N values) as a
// Part read in place, or none where their strides do not allow it (the caller copies).
std::optional<Part> stored_part(const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int bits, int group_size, const int32_t* columns);

}  // namespace justfit

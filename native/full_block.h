// Decode attention over a full-precision block (float32, or float16 where the store keeps
// float32 activations' tokens at half the bytes): the sinks and the hot window, up to two
// pages of the newest positions, read where they lie. Each key and value row is
// read once for all the query rows that meet it (a KV head's queries).
#pragma once

#include <cstdint>

#include "mlx/types/half_types.h"

namespace justfit {

// A block's rows of D values (float or mlx::core::float16_t) where they lie: row and
// leading-index strides in elements.
template <typename T>
struct FullRows {
  const T* data;
  int64_t row, batch;
};

// s[i * ld + t] = q_i . k_t for t < n, for the R query rows i = b * R .. b * R + R - 1 of
// each leading index b < batch (q: rows of D floats; they meet k's index b).
template <typename T>
void full_scores(const float* q, const FullRows<T>& k, int batch, int R, int D, int n, float* s, int ld);

// acc[i * D + d] += sum over t < n of p[i * ld + t] * v_t[d], for the same rows.
template <typename T>
void full_values(const float* p, const FullRows<T>& v, int batch, int R, int D, int n, int ld, float* acc);

}  // namespace justfit

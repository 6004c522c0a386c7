// Decode attention over a full-precision (float32) block: the sinks and the hot window,
// up to two pages of the newest positions, read where they lie. Each key and value row is
// read once for all the query rows that meet it (a KV head's queries).
#pragma once

#include <cstdint>

namespace justfit {

// A block's rows of D floats where they lie: row and leading-index strides in elements.
struct FloatRows {
  const float* data;
  int64_t row, batch;
};

// s[i * ld + t] = q_i . k_t for t < n, for the R query rows i = b * R .. b * R + R - 1 of
// each leading index b < batch (q: rows of D floats; they meet k's index b).
void full_scores(const float* q, const FloatRows& k, int batch, int R, int D, int n, float* s, int ld);

// acc[i * D + d] += sum over t < n of p[i * ld + t] * v_t[d], for the same rows.
void full_values(const float* p, const FloatRows& v, int batch, int R, int D, int n, int ld, float* acc);

}  // namespace justfit

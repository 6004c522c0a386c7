// See attention_fold.h. Each head's keys are transposed once, so scores are register
// tiles of 4 rows x 16 keys. A task is one (batch, KV head, 32 query rows): its rows'
// running state stays in local buffers while every 64-key tile goes by (scores, then each
// row's masked exponentials, then 4 rows x 16 features of p V). Tiles no row sees are skipped.
#include "attention_fold.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "simd.h"
#include "softmax.h"
#include "stored.h"

namespace justfit {

namespace {

constexpr int kRowsPerTask = 32, kKeysPerTile = 64;

// S[i][j] = Q[i] . K[j] for rows [0, rows) (a multiple of 4) and the tile's keys (a
// multiple of 16), KT [D][ld] the tile's keys transposed.
void scores(const float* Q, const float* KT, size_t ld, float* S, int rows, int D, int nt) {
#ifdef __AVX2__
  for (int i0 = 0; i0 < rows; i0 += 4)
    for (int j0 = 0; j0 < nt; j0 += 16) {
      __m256 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(KT + d * ld + j0), k1 = _mm256_loadu_ps(KT + d * ld + j0 + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 qb = _mm256_broadcast_ss(Q + (i0 + r) * D + d);
          acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(S + (i0 + r) * kKeysPerTile + j0, acc[r][0]);
        _mm256_storeu_ps(S + (i0 + r) * kKeysPerTile + j0 + 8, acc[r][1]);
      }
    }
#else
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < nt; ++j) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += Q[i * D + d] * KT[d * ld + j];
      S[i * kKeysPerTile + j] = s;
    }
#endif
}

// O[i] += P[i] @ V for rows [0, rows) (a multiple of 4), V the tile's nt rows of D.
void weighted(const float* P, const float* V, float* O, int rows, int D, int nt) {
#ifdef __AVX2__
  for (int i0 = 0; i0 < rows; i0 += 4)
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m256 acc[4][2];
      for (int r = 0; r < 4; ++r) {
        acc[r][0] = _mm256_loadu_ps(O + (i0 + r) * D + d0);
        acc[r][1] = _mm256_loadu_ps(O + (i0 + r) * D + d0 + 8);
      }
      for (int j = 0; j < nt; ++j) {
        const __m256 v0 = _mm256_loadu_ps(V + static_cast<size_t>(j) * D + d0);
        const __m256 v1 = _mm256_loadu_ps(V + static_cast<size_t>(j) * D + d0 + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 pb = _mm256_broadcast_ss(P + (i0 + r) * kKeysPerTile + j);
          acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(O + (i0 + r) * D + d0, acc[r][0]);
        _mm256_storeu_ps(O + (i0 + r) * D + d0 + 8, acc[r][1]);
      }
    }
#else
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < nt; ++j)
      for (int d = 0; d < D; ++d) O[i * D + d] += P[i * kKeysPerTile + j] * V[static_cast<size_t>(j) * D + d];
#endif
}

// One task's rows against every tile of the block; kt: the head's keys transposed, [D][ld].
void fold_task(const float* q, const float* kt, size_t ld, const float* v, float* m, float* l, float* o, int rows, int D,
               int n, const BlockMask& mask, int r0, std::vector<float>& room) {
  const int padded = (rows + 3) / 4 * 4;
  room.assign(static_cast<size_t>(padded) * D + static_cast<size_t>(padded) * kKeysPerTile +
                  static_cast<size_t>(padded) * D, 0.f);
  float* Q = room.data();
  float* S = Q + static_cast<size_t>(padded) * D;
  float* O = S + static_cast<size_t>(padded) * kKeysPerTile;
  std::memcpy(Q, q, sizeof(float) * rows * D);
  std::memcpy(O, o, sizeof(float) * rows * D);
  int qmin = mask.qpos(r0), qmax = qmin;
  for (int i = 0; i < rows; ++i) {
    qmin = std::min(qmin, mask.qpos(r0 + i));
    qmax = std::max(qmax, mask.qpos(r0 + i));
  }
  for (int t0 = 0; t0 < n; t0 += kKeysPerTile) {
    const int nt = std::min(kKeysPerTile, n - t0);
    const int first = mask.k_start + t0, last = first + nt - 1;
    if (first > qmax || (mask.window > 0 && qmin - last >= mask.window)) continue;  // no row sees the tile
    scores(Q, kt + t0, ld, S, padded, D, (nt + 15) / 16 * 16);
    for (int i = 0; i < rows; ++i) {  // exponentials in place of the scores; the running state rescaled
      int lo, hi;
      float corr, sum;
      visible_run(mask.qpos(r0 + i), first, mask.window, nt, lo, hi);
      step_row(S + i * kKeysPerTile, S + i * kKeysPerTile, lo, hi, nt, m[i], &corr, &m[i], &sum);
      l[i] = l[i] * corr + sum;
      if (corr != 1.f)
        for (int d = 0; d < D; ++d) O[i * D + d] *= corr;
    }
    weighted(S, v + static_cast<size_t>(t0) * D, O, padded, D, nt);
  }
  std::memcpy(o, O, sizeof(float) * rows * D);
}

}  // namespace

std::vector<mx::array> attention_fold(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& m,
                                      const mx::array& l, const mx::array& acc, int L, int q_start, int k_start,
                                      int window, mx::StreamOrDevice s) {
  for (const auto* a : {&q, &k, &v, &m, &l, &acc})
    if (a->dtype() != mx::float32 || a->ndim() != 4)
      throw std::invalid_argument("attention_fold: every input must be float32 [B, kv_heads, rows, D]");
  const int D = q.shape(3), R = q.shape(2);
  if (D % 16 != 0) throw std::invalid_argument("attention_fold: the head size must be a multiple of 16");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(1) != q.shape(1) || k.shape(3) != D)
    throw std::invalid_argument("attention_fold: k and v must be [B, kv_heads, n, D] with q's B, kv_heads and D");
  const mx::Shape rows{q.shape(0), q.shape(1), R, 1};
  if (m.shape() != rows || l.shape() != rows || acc.shape() != q.shape())
    throw std::invalid_argument("attention_fold: m and l must be [B, kv_heads, rows, 1], acc q's shape");
  if (L <= 0 || R % L != 0) throw std::invalid_argument("attention_fold: q's rows must be a multiple of L");
  return mx::array::make_arrays({rows, rows, q.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<AttentionFold>(mx::to_stream(s), BlockMask{L, q_start, k_start, window}),
                                {q, k, v, m, l, acc});
}

void AttentionFold::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = begin_cpu(stream(), inputs, outputs);
  const auto& q = inputs[0];
  const int heads = q.shape(0) * q.shape(1), R = q.shape(2), D = q.shape(3), n = inputs[1].shape(2);
  encoder.dispatch([qs = RowMajor{q}, ks = RowMajor{inputs[1]}, vs = RowMajor{inputs[2]}, ms = RowMajor{inputs[3]},
                    ls = RowMajor{inputs[4]}, as = RowMajor{inputs[5]}, m_out = outputs[0].data<float>(),
                    l_out = outputs[1].data<float>(), o_out = outputs[2].data<float>(), heads, R, D, n,
                    mask = mask_]() mutable {
    const float* qp = qs.data<float>();
    const float* kp = ks.data<float>();
    const float* vp = vs.data<float>();
    std::memcpy(m_out, ms.data<float>(), sizeof(float) * heads * R);
    std::memcpy(l_out, ls.data<float>(), sizeof(float) * heads * R);
    std::memcpy(o_out, as.data<float>(), sizeof(float) * static_cast<size_t>(heads) * R * D);
    const int per_head = (R + kRowsPerTask - 1) / kRowsPerTask;
    const size_t ld = (n + 15) / 16 * 16;  // keys transposed once per head, zero past n
    std::vector<float> kt(static_cast<size_t>(heads) * D * ld, 0.f);
#pragma omp parallel
    {
#pragma omp for schedule(static)
      for (int h = 0; h < heads; ++h)
        for (int t = 0; t < n; ++t)
          for (int d = 0; d < D; ++d)
            kt[(static_cast<size_t>(h) * D + d) * ld + t] = kp[(static_cast<size_t>(h) * n + t) * D + d];
      std::vector<float> room;
#pragma omp for schedule(dynamic)
      for (int task = 0; task < heads * per_head; ++task) {
        const int h = task / per_head, r0 = (task % per_head) * kRowsPerTask, rows = std::min(kRowsPerTask, R - r0);
        const size_t row_at = static_cast<size_t>(h) * R + r0;
        fold_task(qp + row_at * D, kt.data() + static_cast<size_t>(h) * D * ld, ld, vp + static_cast<size_t>(h) * n * D,
                  m_out + row_at, l_out + row_at, o_out + row_at * D, rows, D, n, mask, r0, room);
      }
    }
  });
}

void AttentionFold::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFit's attention_fold runs on the CPU only (on Metal, KVExec's MLX path is used)");
}

bool AttentionFold::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AttentionFold&>(other);
  return mask_ == o.mask_;
}

}  // namespace justfit

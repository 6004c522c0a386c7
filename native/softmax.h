// JustFit's softmax over the last axis for MLX's CPU backend: MLX's CPU softmax takes
// its exponentials one at a time (about 20 ns each here), which at decode is most of
// attention's time at long contexts (9 x 8,192 scores per layer for SmolLM2).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace justfit {

namespace mx = mlx::core;

// mx.softmax(x, axis=-1, precise=True) for float32 x [..., N]: exp(x - max) / sum, in
// float32; rows whose every entry is -inf give NaN, as MLX's do.
mx::array softmax(const mx::array& x, mx::StreamOrDevice s = {});

// One row of it: y = softmax(x[0 .. n)); y may be x.
void softmax_row(const float* x, float* y, int n);

class Softmax : public mx::Primitive {
 public:
  explicit Softmax(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// One block of the online softmax prefill attention folds in: for scores s [B, kv_heads,
// rep * L, n] (row r is query r % L, at position q_start + r % L; key t at k_start + t)
// and the running max m [B, kv_heads, rep * L, 1]: keys later than the query, or
// (window > 0) `window` or more positions earlier, are masked; returns [p, corr, m_new,
// rowsum] with m_new = max(m, the row's visible scores), m_safe = m_new where finite
// else 0, p = exp(s - m_safe) (0 where masked), corr = exp(m - m_safe), rowsum = sum of
// p over the row. One operation on both cores with vector exponentials.
std::vector<mx::array> softmax_step(const mx::array& s, const mx::array& m, int L, int q_start, int k_start,
                                    int window, mx::StreamOrDevice stream = {});

// Which keys each query row of a block sees: a head's rows are L queries (repeated per
// head of a group) from position q_start, the block's keys start at k_start; keys later
// than the query, or with window > 0 `window` or more positions earlier, are masked.
struct BlockMask {
  int L, q_start, k_start, window;
  int qpos(long row) const { return q_start + static_cast<int>(row % L); }  // row within its head
  bool operator==(const BlockMask&) const = default;
};

// The keys a query at qpos sees among n starting at k_start: one run [lo, hi) (not later
// than the query; with window > 0, fewer than `window` positions earlier).
void visible_run(int qpos, int k_start, int window, int n, int& lo, int& hi);

// One row of the step over its visible run: p = exp(s - m_safe) there and 0 elsewhere
// (p may be s), with the row's corr, m_new and sum of p.
void step_row(const float* s, float* p, int lo, int hi, int n, float m, float* corr, float* m_new, float* rowsum);

class SoftmaxStep : public mx::Primitive {
 public:
  SoftmaxStep(mx::Stream stream, BlockMask mask) : mx::Primitive(stream), mask_(mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitSoftmaxStep"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  BlockMask mask_;
};

}  // namespace justfit

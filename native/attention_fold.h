// Prefill's attention over one block of keys as one operation: the scores, the masked
// online softmax and the probability-weighted values computed tile by tile (64 keys
// against 32 query rows at a time, in cache), folded into the running max, sum and
// accumulator. The MLX path makes the block's whole score matrix (rows x keys), its
// exponentials and a product with V, each a pass over memory.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "softmax.h"

namespace justfit {

namespace mx = mlx::core;

// For q [B, kv_heads, R, D] (scaled; row r is query r % L, at position q_start + r % L),
// a block's keys and values k, v [B, kv_heads, n, D] (key t at position k_start + t) and
// the running m, l [B, kv_heads, R, 1] and acc [B, kv_heads, R, D], all float32: returns
// [m, l, acc] after the block, as softmax_step and the fold compute them (keys later than
// the query, or with window > 0 `window` or more positions earlier, are masked). D a
// multiple of 16.
std::vector<mx::array> attention_fold(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& m,
                                      const mx::array& l, const mx::array& acc, int L, int q_start, int k_start,
                                      int window, mx::StreamOrDevice s = {});

class AttentionFold : public mx::Primitive {
 public:
  AttentionFold(mx::Stream stream, BlockMask mask) : mx::Primitive(stream), mask_(mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitAttentionFold"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  BlockMask mask_;
};

}  // namespace justfit

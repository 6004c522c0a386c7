// A decode layer's projections into attention heads as one MLX operation: mlx-lm's
// attention layers reshape and transpose q, k and v into [B, heads, L, D] and rotate q
// and k (eight operations, each costing MLX's dispatch at decode); this primitive does
// all of it in one, with rope.h's arithmetic.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "rope.h"

namespace justfit {

namespace mx = mlx::core;

// q [B, L, heads * D], k and v [B, L, kv_heads * D] float32 -> [q, k, v] as
// [B, heads, L, D] and [B, kv_heads, L, D], q and k rotated as justfit::rope does them
// (positions offset .. offset + L - 1; dims, traditional, scale, inv_freqs as there).
std::vector<mx::array> rope_heads(const mx::array& q, const mx::array& k, const mx::array& v, int heads, int kv_heads,
                                  const mx::array& inv_freqs, int dims, bool traditional, float scale, int offset,
                                  mx::StreamOrDevice s = {});

class RopeHeads : public RopePrimitive {
 public:
  using RopePrimitive::RopePrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitRopeHeads"; }
};

}  // namespace justfit

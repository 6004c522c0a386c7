// A decode layer's projections into attention heads as one MLX operation: mlx-lm's
// attention layers reshape and transpose q, k and v into [B, heads, L, D] and rotate q
// and k (eight operations, each costing MLX's dispatch at decode); this primitive does
// all of it in one, with rope.h's arithmetic.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "rope.h"

namespace justfit {

namespace mx = mlx::core;

// q [B, L, heads * D], k and v [B, L, kv_heads * D] float32 -> [q, k, v] as
// [B, heads, L, D] and [B, kv_heads, L, D], q and k rotated as justfit::rope does them
// (positions offset .. offset + L - 1; dims, traditional, scale, inv_freqs as there).
// With `norms` (q's and k's weights, [D] float32: Gemma 3's q_norm and k_norm) each head
// of q and k is first RMS-normed as rms_norm(x, weight, norm_eps, norm_offset) does.
std::vector<mx::array> rope_heads(const mx::array& q, const mx::array& k, const mx::array& v, int heads, int kv_heads,
                                  const mx::array& inv_freqs, int dims, bool traditional, float scale, int offset,
                                  const std::optional<std::pair<mx::array, mx::array>>& norms = std::nullopt,
                                  float norm_eps = 0.f, float norm_offset = 0.f, mx::StreamOrDevice s = {});

class RopeHeads : public RopePrimitive {
 public:
  RopeHeads(mx::Stream stream, int dims, bool traditional, float scale, int offset, float norm_eps, float norm_offset)
      : RopePrimitive(stream, dims, traditional, scale, offset), norm_eps_(norm_eps), norm_offset_(norm_offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitRopeHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RopeHeads&>(other);
    return RopePrimitive::is_equivalent(other) && norm_eps_ == o.norm_eps_ && norm_offset_ == o.norm_offset_;
  }

 private:
  float norm_eps_;
  float norm_offset_;
};

}  // namespace justfit

// JustFit's rotary position embedding for MLX's CPU backend: `mx.fast.rope`'s CPU
// path is its fallback, about twenty operations a call; this primitive is one.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace justfit {

namespace mx = mlx::core;

// mx.fast.rope(x, dims, traditional=, base=, scale=, offset=) for float32 x [..., L, D]
// (any strides): the first `dims` features of each vector at position offset + l are
// rotated, in pairs (2i, 2i + 1) when `traditional`, else (i, i + dims / 2), by the
// angle ((l + offset) * scale) * inv_freqs[i], in float32 as MLX computes it; the rest
// pass through. inv_freqs [dims / 2]: float32 (MLX's exp(-i * log(base) / (dims / 2))).
mx::array rope(const mx::array& x, const mx::array& inv_freqs, int dims, bool traditional, float scale, int offset,
               mx::StreamOrDevice s = {});

// The angles of positions offset .. offset + L - 1: cos and sin [L, dims / 2], computed in
// float32 from inv_freqs as MLX computes them (so the same rounding).
void rope_angles(const float* inv_freqs, int L, int dims, int offset, float scale, std::vector<float>& cs,
                 std::vector<float>& sn);

// What a rotary embedding's primitives are equivalent by, and their refusal on Metal.
class RopePrimitive : public mx::Primitive {
 public:
  RopePrimitive(mx::Stream stream, int dims, bool traditional, float scale, int offset)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), scale_(scale), offset_(offset) {}

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  int dims_;
  bool traditional_;
  float scale_;
  int offset_;
};

class Rope : public RopePrimitive {
 public:
  using RopePrimitive::RopePrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitRope"; }
};

}  // namespace justfit

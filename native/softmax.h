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

}  // namespace justfit

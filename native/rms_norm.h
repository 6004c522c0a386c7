// JustFit's RMS norm for MLX's CPU backend: `mx.fast.rms_norm`'s CPU path is its
// fallback, five or six operations a call; this primitive is one.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace justfit {

namespace mx = mlx::core;

// mx.fast.rms_norm(x, weight, eps) for float32 x [..., D] and weight [D]:
// x / sqrt(mean(x ** 2) + eps) * weight, the mean accumulated in float32.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

}  // namespace justfit

// JustFit's RMS norm for MLX's CPU backend: `mx.fast.rms_norm`'s CPU path is its
// fallback, five or six operations a call; this primitive is one.
#pragma once

#include <cmath>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace justfit {

namespace mx = mlx::core;

// mx.fast.rms_norm(x, weight + weight_offset, eps) for float32 x [..., D] and weight [D]:
// x / sqrt(mean(x ** 2) + eps) * (weight + weight_offset), the mean accumulated in float32
// (weight_offset 1: Gemma's norms, which scale by 1 + weight).
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, float weight_offset = 0.f,
                   mx::StreamOrDevice s = {});

// One vector's norm into `y` (rope_heads' q and k norms too).
inline void rms_norm_row(const float* x, const float* w, float* y, int D, float eps, float weight_offset) {
  float squares = 0.f;
  for (int j = 0; j < D; ++j) squares += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(D) + eps);
  for (int j = 0; j < D; ++j) y[j] = x[j] * inv * (w[j] + weight_offset);
}

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps, float weight_offset)
      : mx::Primitive(stream), eps_(eps), weight_offset_(weight_offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
  float weight_offset_;
};

}  // namespace justfit

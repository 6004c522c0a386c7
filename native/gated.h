// A gated MLP's activation as one MLX operation with vector exponentials: silu(gate) * up
// (llama's SwiGLU) or gelu_approx(gate) * up (Gemma's). MLX's CPU computes the compiled
// versions one element at a time on one core, a large share of prefill's time.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace justfit {

namespace mx = mlx::core;

enum GateKind { kSilu = 0, kGeluApprox = 1 };

// act(gate) * up for float32 gate and up of one shape; act per `kind` (GateKind):
// silu(x) = x * sigmoid(x); gelu_approx(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
mx::array gated_activation(const mx::array& gate, const mx::array& up, int kind, mx::StreamOrDevice s = {});

// y[i] = act(g[i]) * u[i] for n elements, spans of them on both cores (a fused product's gate too).
void gated(const float* g, const float* u, float* y, size_t n, int kind);

class GatedActivation : public mx::Primitive {
 public:
  GatedActivation(mx::Stream stream, int kind) : mx::Primitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  const char* name() const override { return "JustFitGatedActivation"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const GatedActivation&>(other).kind_;
  }

 private:
  int kind_;
};

}  // namespace justfit

// JustFit's native kernels for MLX's CPU backend: a matrix-vector (and small
// matrix-matrix) product on MLX's affine-quantized weights in their stored layout,
// reading each weight once for every row of the input.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "stored.h"

namespace justfit {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T for w [out, in * bits / 32] (uint32),
// scales and biases [out, in / group_size] (float16 or float32), x [..., in]; float32 in and out.
// int8_activations: x's blocks of 32 rounded to int8 (scaled by their largest magnitude)
// and multiplied by the weights in integers, as llama.cpp does (AVX2; the bias term stays
// exact); otherwise in float32.
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool int8_activations = false,
                           mx::StreamOrDevice s = {});

class QuantizedMatvec : public QuantizedPrimitive {
 public:
  QuantizedMatvec(mx::Stream stream, int group_size, int bits, bool int8)
      : QuantizedPrimitive(stream, group_size, bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitQuantizedMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return QuantizedPrimitive::is_equivalent(other) && int8_ == static_cast<const QuantizedMatvec&>(other).int8_;
  }

 private:
  bool int8_;
};

}  // namespace justfit

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
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

class QuantizedMatvec : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitQuantizedMatvec"; }
};

}  // namespace justfit

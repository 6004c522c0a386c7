// Dequantization of MLX's affine-quantized weights to float32 on the CPU: what prefill's
// dense working copies are made by. MLX's CPU dequantize takes a 5-bit matrix about five
// times as long as a 4- or 8-bit one (bit by bit); this one unpacks every width by
// vectors and splits rows over both cores.
#pragma once

#include "mlx/ops.h"
#include "stored.h"

namespace justfit {

namespace mx = mlx::core;

// mx.dequantize(w, scales, biases, group_size, bits) in float32 for w [..., rows, in * bits / 32]
// (uint32; bits 4, 5, 6 or 8), scales and biases [..., rows, in / group_size] (float16 or float32).
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     mx::StreamOrDevice s = {});

class Dequantize : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitDequantize"; }
};

}  // namespace justfit

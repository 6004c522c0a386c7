// JustFit's product of a few rows with MLX's affine-quantized matrices in the
// untransposed layout (groups along each row of W): what attention over quantized KV
// pages computes at decode, q K (keys stored per channel) and p V (values per token).
// MLX's CPU quantized_matmul reads such pages at about 1 GB/s here.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "stored.h"

namespace justfit {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases) for x [..., M, K] float32, w [..., K, N * bits / 32]
// (uint32), scales and biases [..., K, N / group_size] (float16 or float32), the leading
// dimensions equal; y [..., M, N] float32. bits 4 or 8; group_size a multiple of 8.
mx::array quantized_matmul_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

class QuantizedMatmulRows : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitQuantizedMatmulRows"; }
};

}  // namespace justfit

// JustFit's native kernels for MLX's CPU backend: a matrix-vector (and small
// matrix-matrix) product on MLX's affine-quantized weights in their stored layout,
// reading each weight once for every row of the input.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "stored.h"

namespace justfit {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T for w [out, in * bits / 32] (uint32; bits 4, 5, 6 or 8),
// scales and biases [out, in / group_size] (float16 or float32), x [..., in]; float32 in and out.
// activation_bits 8 or 16: x's blocks of 32 rounded to int8 or int16 (scaled by their
// largest magnitude) and multiplied by the weights in integers (AVX2, qmatvec_int.h);
// 32: in float32.
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, int activation_bits = 32,
                           mx::StreamOrDevice s = {});

// The products of one x with several weights (same in, group_size and scales dtype; a
// bit width each) as one operation with an output each.
std::vector<mx::array> quantized_matvecs(const mx::array& x, const std::vector<mx::array>& w,
                                         const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                         int group_size, const std::vector<int>& bits, int activation_bits = 32,
                                         mx::StreamOrDevice s = {});

// The weight widths the matvec reads (MLX's affine packing).
constexpr bool matvec_width(int bits) { return bits == 4 || bits == 5 || bits == 6 || bits == 8; }

class QuantizedMatvec : public QuantizedPrimitive {
 public:
  QuantizedMatvec(mx::Stream stream, int group_size, const std::vector<int>& bits, int activation_bits)
      : QuantizedPrimitive(stream, group_size, bits[0]), widths_(bits), activation_bits_(activation_bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitQuantizedMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatvec&>(other);
    return QuantizedPrimitive::is_equivalent(other) && widths_ == o.widths_ && activation_bits_ == o.activation_bits_;
  }

 private:
  std::vector<int> widths_;  // each weight's
  int activation_bits_;
};

}  // namespace justfit

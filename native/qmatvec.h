// JustFit's native kernels for MLX's CPU backend: a matrix-vector (and small
// matrix-matrix) product on MLX's affine-quantized weights in their stored layout,
// reading each weight once for every row of the input.
#pragma once

#include <optional>

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

// What the products of one x may do around themselves in the same operation: the steps
// of a decode layer that MLX would otherwise dispatch one by one, each at a cost.
// `norm`: x is RMS-normed by this weight first; `gate` (a GateKind, gated.h) >= 0: the
// two products become one output, act(y0) * y1; `post_norm`: the single output is
// RMS-normed by this weight; `residual`: then added to it. Both norms take norm_eps and
// weights + norm_offset; each step computes what its own operation would, bit for bit.
struct MatvecFusion {
  std::optional<mx::array> norm, post_norm, residual;
  float norm_eps = 0.f, norm_offset = 0.f;
  int gate = -1;
};

// The products of one x with several weights (same in, group_size and scales dtype; a
// bit width each) as one operation with an output each (one in all with a gate).
std::vector<mx::array> quantized_matvecs(const mx::array& x, const std::vector<mx::array>& w,
                                         const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                         int group_size, const std::vector<int>& bits, int activation_bits = 32,
                                         const MatvecFusion& fusion = {}, mx::StreamOrDevice s = {});

// The weight widths the matvec reads (MLX's affine packing).
constexpr bool matvec_width(int bits) { return bits == 4 || bits == 5 || bits == 6 || bits == 8; }

class QuantizedMatvec : public QuantizedPrimitive {
 public:
  // The fusion's arrays follow the weights' among the inputs (norm, post_norm, residual).
  struct Steps {
    bool norm, post_norm, residual;
    float eps, offset;
    int gate;
    bool operator==(const Steps&) const = default;
  };
  QuantizedMatvec(mx::Stream stream, int group_size, const std::vector<int>& bits, int activation_bits, Steps steps)
      : QuantizedPrimitive(stream, group_size, bits[0]), widths_(bits), activation_bits_(activation_bits),
        steps_(steps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitQuantizedMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatvec&>(other);
    return QuantizedPrimitive::is_equivalent(other) && widths_ == o.widths_ && activation_bits_ == o.activation_bits_ &&
           steps_ == o.steps_;
  }

 private:
  std::vector<int> widths_;  // each weight's
  int activation_bits_;
  Steps steps_;
};

}  // namespace justfit

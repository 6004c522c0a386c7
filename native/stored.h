// How the native kernels read MLX's affine-quantized storage: scales and biases as
// stored (float16 or float32), the bit width a template parameter.
#pragma once

#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/types/half_types.h"

namespace justfit {

// A primitive's single float32 output allocated and every array registered with the
// stream's CPU encoder, which is returned for the kernel's dispatch.
inline mlx::core::cpu::CommandEncoder& begin_cpu(mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs,
                                                 mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  return encoder;
}

// `a` for a kernel that reads rows: itself where it is computed and row-contiguous (stored
// pages, weights: no graph node at all), else through a Contiguous node (no copy either
// where it turns out row-major when computed).
inline mlx::core::array row_major_input(const mlx::core::array& a, mlx::core::Stream stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mlx::core::contiguous(a, false, stream);
}

// A CPU-only primitive over quantized weights: what two are equivalent by, and the
// refusal on Metal (there MLX's own quantized kernels run).
class QuantizedPrimitive : public mlx::core::Primitive {
 public:
  QuantizedPrimitive(mlx::core::Stream stream, int group_size, int bits)
      : mlx::core::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only (on Metal, MLX's own kernels are used)");
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    auto& o = static_cast<const QuantizedPrimitive&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 protected:
  int group_size_;
  int bits_;
};

// f.template operator()<Bits>(scales, biases) for `bits` among Widths, the pointers
// typed as stored.
template <int... Widths, typename F>
inline void with_stored(int bits, bool half, const void* scales, const void* biases, F&& f) {
  auto go = [&](auto* s, auto* b) {
    bool done = ((bits == Widths ? (f.template operator()<Widths>(s, b), true) : false) || ...);
    if (!done) throw std::invalid_argument("unsupported bit width");
  };
  if (half)
    go(static_cast<const mlx::core::float16_t*>(scales), static_cast<const mlx::core::float16_t*>(biases));
  else
    go(static_cast<const float*>(scales), static_cast<const float*>(biases));
}

}  // namespace justfit

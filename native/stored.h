// How the native kernels read MLX's affine-quantized storage: scales and biases as
// stored (float16 or float32), the bit width a template parameter.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/types/half_types.h"

namespace justfit {

// A primitive's single output allocated and every array registered with the
// stream's CPU encoder, which is returned for the kernel's dispatch.
inline mlx::core::cpu::CommandEncoder& begin_cpu(mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs,
                                                 mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  return encoder;
}

// The same for a primitive with several outputs.
inline mlx::core::cpu::CommandEncoder& begin_cpu(mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs,
                                                 std::vector<mlx::core::array>& outputs) {
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (auto& a : inputs) encoder.set_input_array(a);
  for (auto& out : outputs) {
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  return encoder;
}

// An input's bytes in row-major order, for a kernel that reads rows: its own where it is
// row-contiguous when computed (hidden states, stored pages, weights), else a copy made
// when the kernel runs. Copying there rather than through a Contiguous node keeps such
// nodes out of the graph: at decode each node costs MLX's dispatch whether it copies or
// not.
struct RowMajor {
  mlx::core::array a;
  std::vector<uint8_t> copy;

  template <typename T>
  const T* data() {
    if (a.flags().row_contiguous) return a.data<T>();
    if (copy.empty()) fill();
    return reinterpret_cast<const T*>(copy.data());
  }

 private:
  // Run by run over the last axis (a memcpy each where it is unit-strided).
  void fill() {
    const size_t item = a.itemsize(), ndim = a.ndim();
    copy.resize(a.size() * item);
    if (a.size() == 0) return;
    const uint8_t* base = a.data<uint8_t>();
    const int64_t n = ndim ? a.shape(-1) : 1, last = ndim ? a.strides()[ndim - 1] : 1;
    std::vector<int> index(ndim ? ndim - 1 : 0, 0);
    for (size_t out = 0; out < copy.size(); out += n * item) {
      int64_t at = 0;
      for (size_t d = 0; d + 1 < ndim; ++d) at += static_cast<int64_t>(index[d]) * a.strides()[d];
      if (last == 1) {
        std::memcpy(copy.data() + out, base + at * static_cast<int64_t>(item), n * item);
      } else {
        for (int64_t j = 0; j < n; ++j)
          std::memcpy(copy.data() + out + j * item, base + (at + j * last) * static_cast<int64_t>(item), item);
      }
      for (int d = static_cast<int>(ndim) - 2; d >= 0 && ++index[d] == a.shape(d); --d) index[d] = 0;
    }
  }
};

// `a` as an input to keep unevaluated: itself where it is computed and row-contiguous,
// else through a Contiguous node (for inputs a kernel reads by pointer outside its
// dispatch; RowMajor is the way for the rest).
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

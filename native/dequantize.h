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
// (uint32; bits 2, 3, 4, 5, 6 or 8), scales and biases [..., rows, in / group_size] (float16 or float32).
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     mx::StreamOrDevice s = {});

// Keys stored per channel (tokens last: w [B, kv_heads, n_i, T * bits_i / 32], scales and
// biases [B, kv_heads, n_i, T / group_size]), each part's channels at `columns[i]` of the
// head ([kv_heads, n_i] int32; none: one part, in order), back as float32 tokens-major
// [B, kv_heads, T, head_dim] in one operation: what prefill's attention takes. Per part
// dequantize, a transpose, a concatenation and a gather were four passes, three of them
// MLX's single-threaded copies.
mx::array dequantize_channels(const std::vector<mx::array>& w, const std::vector<mx::array>& scales,
                              const std::vector<mx::array>& biases, const std::vector<mx::array>& columns,
                              int group_size, const std::vector<int>& bits, int head_dim, mx::StreamOrDevice s = {});

constexpr bool dequantize_width(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}

class Dequantize : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "JustFitDequantize"; }
};

class DequantizeChannels : public mx::Primitive {
 public:
  DequantizeChannels(mx::Stream stream, int group_size, std::vector<int> bits, bool columns)
      : mx::Primitive(stream), group_size_(group_size), bits_(std::move(bits)), columns_(columns) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  const char* name() const override { return "JustFitDequantizeChannels"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  std::vector<int> bits_;
  bool columns_;
};

}  // namespace justfit

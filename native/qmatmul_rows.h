// JustFit's product of a few rows with MLX's affine-quantized matrices in the
// untransposed layout (groups along each row of W): what attention over quantized KV
// pages computes at decode, q K (keys stored per channel) and p V (values per token).
// MLX's CPU quantized_matmul reads such pages far below the memory's bandwidth.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "stored.h"

#include <stdexcept>
#include <vector>

namespace justfit {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases) for x [..., M, K] float32, w [..., K, N * bits / 32]
// (uint32), scales and biases [..., K, N / group_size] (float16 or float32), the leading
// dimensions equal; y [..., M, N] float32. bits 2, 3, 4, 5, 6 or 8; group_size a multiple of 8.
mx::array quantized_matmul_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

// The sum over parts i of x[..., columns[i][head]] @ dequantize(w[i], scales[i], biases[i]),
// each part with its own width bits[i] and its rows meeting the columns of x that
// columns[i] ([heads, rows] int32, heads = x.shape(-3)) names; no columns: every part's
// rows are x's columns in order. Keys whose channels are stored at several widths
// (kvexec/allocated.py) are scored in one operation.
mx::array quantized_matmul_rows_split(const mx::array& x, const std::vector<mx::array>& w,
                                      const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                      const std::vector<mx::array>& columns, int group_size,
                                      const std::vector<int>& bits, mx::StreamOrDevice s = {});

class QuantizedMatmulRows : public mx::Primitive {
 public:
  QuantizedMatmulRows(mx::Stream stream, int group_size, std::vector<int> widths, bool split)
      : mx::Primitive(stream), group_size_(group_size), widths_(std::move(widths)), split_(split) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("JustFitQuantizedMatmulRows runs on the CPU only (on Metal, MLX's own kernels are used)");
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatmulRows&>(other);
    return group_size_ == o.group_size_ && widths_ == o.widths_ && split_ == o.split_;
  }
  const char* name() const override { return "JustFitQuantizedMatmulRows"; }

 private:
  int group_size_;
  std::vector<int> widths_;
  bool split_;
};

}  // namespace justfit

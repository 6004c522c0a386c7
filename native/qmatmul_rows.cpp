// See qmatmul_rows.h; the product itself is page_product.cpp's.
#include "qmatmul_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "page_product.h"

namespace justfit {

namespace {

void check_part(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                int group_size, int bits, int rows, int N) {
  if (bits < 2 || bits > 8 || bits == 7)
    throw std::invalid_argument("quantized_matmul_rows: bits must be 2, 3, 4, 5, 6 or 8");
  if (w.dtype() != mx::uint32)
    throw std::invalid_argument("quantized_matmul_rows: w must be uint32");
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    throw std::invalid_argument("quantized_matmul_rows: scales and biases must both be float16 or both float32");
  const int nd = x.ndim();
  if (w.ndim() != nd || scales.ndim() != nd || biases.shape() != scales.shape())
    throw std::invalid_argument("quantized_matmul_rows: x, w, scales and biases need the same number of dimensions");
  if (w.shape(-2) != rows || scales.shape(-2) != rows || w.shape(-1) * 32 / bits != N ||
      scales.shape(-1) != N / group_size || N % group_size != 0)
    throw std::invalid_argument("quantized_matmul_rows: shapes do not agree");
  for (int d = 0; d < nd - 2; ++d)
    if (w.shape(d) != x.shape(d) || scales.shape(d) != x.shape(d))
      throw std::invalid_argument("quantized_matmul_rows: leading dimensions must be equal");
}

}  // namespace

mx::array quantized_matmul_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  return quantized_matmul_rows_split(x, {w}, {scales}, {biases}, {}, group_size, {bits}, s);
}

mx::array quantized_matmul_rows_split(const mx::array& x, const std::vector<mx::array>& w,
                                      const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                      const std::vector<mx::array>& columns, int group_size,
                                      const std::vector<int>& bits, mx::StreamOrDevice s) {
  if (group_size % 8 != 0 || group_size <= 0)
    throw std::invalid_argument("quantized_matmul_rows: group_size must be a positive multiple of 8");
  if (x.dtype() != mx::float32 || x.ndim() < 2)
    throw std::invalid_argument("quantized_matmul_rows: x must be float32 with 2 or more dimensions");
  const size_t parts = w.size();
  if (parts == 0 || scales.size() != parts || biases.size() != parts || bits.size() != parts ||
      (!columns.empty() && columns.size() != parts))
    throw std::invalid_argument("quantized_matmul_rows: one w, scales, biases and bits (and columns) per part");
  const int N = w[0].shape(-1) * 32 / bits[0], heads = x.ndim() >= 3 ? x.shape(-3) : 1;
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs{x};  // read through RowMajor: no graph node
  for (size_t i = 0; i < parts; ++i) {
    const int rows = columns.empty() ? x.shape(-1) : columns[i].shape(-1);
    if (!columns.empty() && (columns[i].dtype() != mx::int32 || columns[i].ndim() != 2 || columns[i].shape(0) != heads))
      throw std::invalid_argument("quantized_matmul_rows: columns must be int32 [heads, rows]");
    check_part(x, w[i], scales[i], biases[i], group_size, bits[i], rows, N);
    if (scales[i].dtype() != scales[0].dtype())
      throw std::invalid_argument("quantized_matmul_rows: every part's scales must share a dtype");
    // Stored pages are read where they lie (a segment's storage holds more tokens than are
    // written: strided rows); anything else is made row-major first.
    const bool in_place = w[i].is_available() && scales[i].is_available() && biases[i].is_available() &&
                          stored_part(w[i], scales[i], biases[i], bits[i], group_size, nullptr).has_value();
    for (const auto* a : {&w[i], &scales[i], &biases[i]}) inputs.push_back(in_place ? *a : mx::contiguous(*a, false, stream));
    if (!columns.empty()) inputs.push_back(row_major_input(columns[i], stream));
  }
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantizedMatmulRows>(stream, group_size, bits, !columns.empty()), inputs);
}

void QuantizedMatmulRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  const int D = x.shape(-1), M = x.shape(-2), N = y.shape(-1), batch = x.size() / (static_cast<size_t>(M) * D);
  const int heads = x.ndim() >= 3 ? x.shape(-3) : 1;
  const int per = split_ ? 4 : 3;
  std::vector<Part> parts;
  for (size_t i = 0; i < widths_.size(); ++i) {
    auto part = stored_part(inputs[1 + per * i], inputs[2 + per * i], inputs[3 + per * i], widths_[i], group_size_,
                            split_ ? inputs[4 + per * i].data<int32_t>() : nullptr);
    if (!part) throw std::runtime_error("quantized_matmul_rows: a stored part's strides changed before it ran");
    parts.push_back(*part);
  }
  const bool half = inputs[2].dtype() == mx::float16;
  encoder.dispatch([=, xs = RowMajor{x}, yp = y.data<float>(), gs = group_size_]() mutable {
    product(xs.data<float>(), parts, half, yp, batch, heads, M, D, N, gs, N);
  });
}

}  // namespace justfit

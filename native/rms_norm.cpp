// See rms_norm.h. One pass for the sum of squares, one to scale; rows are independent.
#include "rms_norm.h"

#include <cmath>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "stored.h"

namespace justfit {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, float weight_offset, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32)
    throw std::invalid_argument("rms_norm: x and weight must be float32");
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: weight must be [D] for x [..., D]");
  auto stream = mx::to_stream(s);
  // The kernel reads rows (RowMajor: no graph node, a copy only where they are not row-major).
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps, weight_offset), {x, weight});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  encoder.dispatch([xs = RowMajor{x}, ws = RowMajor{w}, yp = y.data<float>(), D = x.shape(-1),
                    rows = x.size() / x.shape(-1), eps = eps_, offset = weight_offset_]() mutable {
    const float* xp = xs.data<float>();
    const float* wp = ws.data<float>();
    for (size_t r = 0; r < rows; ++r) rms_norm_row(xp + r * D, wp, yp + r * D, D, eps, offset);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFit's rms_norm runs on the CPU only (on Metal, mx.fast.rms_norm is MLX's own)");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && weight_offset_ == o.weight_offset_;
}

}  // namespace justfit

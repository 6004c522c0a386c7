// See rope.h. The angles are computed once per position, in float32 from the same
// inverse frequencies as MLX's (so the same rounding), then applied to every vector at
// that position.
#include "rope.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "stored.h"

namespace justfit {

mx::array rope(const mx::array& x, const mx::array& inv_freqs, int dims, bool traditional, float scale, int offset,
               mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || inv_freqs.dtype() != mx::float32)
    throw std::invalid_argument("rope: x and inv_freqs must be float32");
  if (x.ndim() < 2) throw std::invalid_argument("rope: x needs at least 2 dimensions [..., L, D]");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1))
    throw std::invalid_argument("rope: dims must be even, positive and at most the last dimension");
  if (inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("rope: inv_freqs must have dims / 2 entries");
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(stream, dims, traditional, scale, offset),
                   {x, row_major_input(inv_freqs, stream)});
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& inv = inputs[1];
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  encoder.dispatch([x, inv, yp = y.data<float>(), dims = dims_, traditional = traditional_, scale = scale_,
                    offset = offset_]() {
    const int ndim = x.ndim(), D = x.shape(-1), L = x.shape(-2), half = dims / 2;
    const size_t rows = x.size() / D;
    std::vector<float> cs, sn;
    rope_angles(inv.data<float>(), L, dims, offset, scale, cs, sn);
    const float* xp = x.data<float>();
    const auto& strides = x.strides();
    std::vector<int> index(ndim - 1, 0);  // over every axis but the last
    for (size_t r = 0; r < rows; ++r) {
      int64_t at = 0;
      for (int d = 0; d < ndim - 1; ++d) at += static_cast<int64_t>(index[d]) * strides[d];
      const int64_t step = strides[ndim - 1];
      const int l = index[ndim - 2];
      const float* c = cs.data() + static_cast<size_t>(l) * half;
      const float* sv = sn.data() + static_cast<size_t>(l) * half;
      float* out = yp + r * D;
      for (int i = 0; i < half; ++i) {
        const int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
        const float x1 = xp[at + a * step], x2 = xp[at + b * step];
        out[a] = x1 * c[i] - x2 * sv[i];
        out[b] = x1 * sv[i] + x2 * c[i];
      }
      for (int j = dims; j < D; ++j) out[j] = xp[at + j * step];
      for (int d = ndim - 2; d >= 0 && ++index[d] == x.shape(d); --d) index[d] = 0;
    }
  });
}

void rope_angles(const float* inv_freqs, int L, int dims, int offset, float scale, std::vector<float>& cs,
                 std::vector<float>& sn) {
  const int half = dims / 2;
  cs.resize(static_cast<size_t>(L) * half);
  sn.resize(cs.size());
  for (int l = 0; l < L; ++l) {
    const float position = (static_cast<float>(l) + static_cast<float>(offset)) * scale;
    for (int i = 0; i < half; ++i) {
      const float theta = position * inv_freqs[i];
      cs[static_cast<size_t>(l) * half + i] = std::cos(theta);
      sn[static_cast<size_t>(l) * half + i] = std::sin(theta);
    }
  }
}

void RopePrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + " runs on the CPU only (on Metal, mx.fast.rope is MLX's own kernel)");
}

bool RopePrimitive::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RopePrimitive&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_ && offset_ == o.offset_;
}

}  // namespace justfit

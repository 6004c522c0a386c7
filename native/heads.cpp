// See heads.h. The angles are computed once per position (rope.h's rope_angles).
#include "heads.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "rms_norm.h"
#include "stored.h"

namespace justfit {

namespace {

// An RMS norm's weight, eps and weight offset for each head (rms_norm.h).
struct HeadNorm {
  const float* weight;
  float eps, offset;
};

// x [B, L, H, D] (row-major) -> y [B, H, L, D], normed first when `norm` is given and
// rotated when cs is.
void to_heads(const float* x, float* y, int B, int L, int H, int D, const float* cs, const float* sn, int dims,
              bool traditional, const HeadNorm* norm = nullptr) {
  const int half = dims / 2;
  std::vector<float> normed(norm ? D : 0);
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const float* in = x + ((static_cast<size_t>(b) * L + l) * H + h) * D;
        float* out = y + ((static_cast<size_t>(b) * H + h) * L + l) * D;
        if (norm) {
          rms_norm_row(in, norm->weight, normed.data(), D, norm->eps, norm->offset);
          in = normed.data();
        }
        if (cs == nullptr) {
          std::memcpy(out, in, D * sizeof(float));
          continue;
        }
        const float* c = cs + static_cast<size_t>(l) * half;
        const float* s = sn + static_cast<size_t>(l) * half;
        for (int i = 0; i < half; ++i) {
          const int a = traditional ? 2 * i : i, e = traditional ? 2 * i + 1 : i + half;
          const float x1 = in[a], x2 = in[e];
          out[a] = x1 * c[i] - x2 * s[i];
          out[e] = x1 * s[i] + x2 * c[i];
        }
        for (int j = dims; j < D; ++j) out[j] = in[j];
      }
}

}  // namespace

std::vector<mx::array> rope_heads(const mx::array& q, const mx::array& k, const mx::array& v, int heads, int kv_heads,
                                  const mx::array& inv_freqs, int dims, bool traditional, float scale, int offset,
                                  const std::optional<std::pair<mx::array, mx::array>>& norms, float norm_eps,
                                  float norm_offset, mx::StreamOrDevice s) {
  for (const auto* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 3)
      throw std::invalid_argument("rope_heads: q, k and v must be float32 [B, L, heads * D]");
  if (heads <= 0 || kv_heads <= 0 || q.shape(-1) % heads != 0)
    throw std::invalid_argument("rope_heads: heads must divide q's last dimension");
  const int B = q.shape(0), L = q.shape(1), D = q.shape(-1) / heads;
  if (k.shape() != mx::Shape{B, L, kv_heads * D} || v.shape() != k.shape())
    throw std::invalid_argument("rope_heads: k and v must be [B, L, kv_heads * D] with q's head size");
  if (dims <= 0 || dims % 2 != 0 || dims > D)
    throw std::invalid_argument("rope_heads: dims must be even, positive and at most the head size");
  if (inv_freqs.dtype() != mx::float32 || inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("rope_heads: inv_freqs must be float32 with dims / 2 entries");
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs{q, k, v, row_major_input(inv_freqs, stream)};
  if (norms) {
    for (const auto* w : {&norms->first, &norms->second})
      if (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != D)
        throw std::invalid_argument("rope_heads: norms must be float32 [D] weights for q and k");
    inputs.push_back(row_major_input(norms->first, stream));
    inputs.push_back(row_major_input(norms->second, stream));
  }
  return mx::array::make_arrays({{B, heads, L, D}, {B, kv_heads, L, D}, {B, kv_heads, L, D}},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<RopeHeads>(stream, dims, traditional, scale, offset, norm_eps, norm_offset),
                                inputs);
}

void RopeHeads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = begin_cpu(stream(), inputs, outputs);
  std::vector<float*> ys;
  for (auto& y : outputs) ys.push_back(y.data<float>());
  const int B = outputs[0].shape(0), H = outputs[0].shape(1), L = outputs[0].shape(2), D = outputs[0].shape(3);
  const int KVH = outputs[1].shape(1);
  encoder.dispatch([=, q = RowMajor{inputs[0]}, k = RowMajor{inputs[1]}, v = RowMajor{inputs[2]},
                    inv = inputs[3].data<float>(), dims = dims_, traditional = traditional_, scale = scale_,
                    offset = offset_,
                    q_norm = HeadNorm{inputs.size() == 6 ? inputs[4].data<float>() : nullptr, norm_eps_, norm_offset_},
                    k_norm = HeadNorm{inputs.size() == 6 ? inputs[5].data<float>() : nullptr, norm_eps_, norm_offset_}]() mutable {
    std::vector<float> cs, sn;
    rope_angles(inv, L, dims, offset, scale, cs, sn);
    to_heads(q.data<float>(), ys[0], B, L, H, D, cs.data(), sn.data(), dims, traditional, q_norm.weight ? &q_norm : nullptr);
    to_heads(k.data<float>(), ys[1], B, L, KVH, D, cs.data(), sn.data(), dims, traditional, k_norm.weight ? &k_norm : nullptr);
    to_heads(v.data<float>(), ys[2], B, L, KVH, D, nullptr, nullptr, dims, traditional);
  });
}

}  // namespace justfit

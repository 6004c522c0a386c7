// See softmax.h. Per row: the max, exp(x - max) written out while summed, then one
// scaling pass. With AVX2 the exponential is simd.h's vector polynomial.
#include "softmax.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "simd.h"
#include "stored.h"

namespace justfit {

namespace {

#ifdef __AVX2__
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#endif

}  // namespace

void softmax_row(const float* x, float* y, int n) {
  int j = 0;
  float top = -std::numeric_limits<float>::infinity();
#ifdef __AVX2__
  __m256 vmax = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + j));
  top = hmax(vmax);
#endif
  for (; j < n; ++j) top = std::max(top, x[j]);
  float sum = 0.f;
  j = 0;
#ifdef __AVX2__
  const __m256 shift = _mm256_set1_ps(top);
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift));
    _mm256_storeu_ps(y + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; j < n; ++j) sum += (y[j] = std::exp(x[j] - top));
  const float inv = 1.0f / sum;  // a row of -inf: top is -inf, x - top NaN, as MLX's
  for (j = 0; j < n; ++j) y[j] *= inv;
}

mx::array softmax(const mx::array& x, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("softmax: x must be float32");
  if (x.ndim() < 1) throw std::invalid_argument("softmax: x needs at least one axis");
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(stream), {x});
}

void Softmax::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  encoder.dispatch([xs = RowMajor{x}, yp = y.data<float>(), n = x.shape(-1), rows = x.size() / x.shape(-1)]() mutable {
    const float* xp = xs.data<float>();
    const long total = static_cast<long>(rows) * n;
#pragma omp parallel for schedule(static) if (total >= (1 << 18))
    for (long r = 0; r < static_cast<long>(rows); ++r) softmax_row(xp + r * n, yp + r * n, n);
  });
}

void Softmax::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFit's softmax runs on the CPU only (on Metal, mx.softmax is MLX's own)");
}

void visible_run(int qpos, int k_start, int window, int n, int& lo, int& hi) {
  hi = std::clamp(qpos - k_start + 1, 0, n);
  lo = window > 0 ? std::clamp(qpos - window + 1 - k_start, 0, hi) : 0;
}

void step_row(const float* s, float* p, int lo, int hi, int n, float m, float* corr, float* m_new, float* rowsum) {
  const float inf = std::numeric_limits<float>::infinity();
  float top = m;
  for (int t = lo; t < hi; ++t) top = std::max(top, s[t]);
  const float safe = top == -inf ? 0.f : top;
  float sum = 0.f;
  for (int t = 0; t < lo; ++t) p[t] = 0.f;
  int t = lo;
#ifdef __AVX2__
  const __m256 shift = _mm256_set1_ps(safe);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= hi; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(p + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; t < hi; ++t) sum += (p[t] = std::exp(s[t] - safe));
  for (t = hi; t < n; ++t) p[t] = 0.f;
  *corr = m == -inf ? 0.f : std::exp(m - safe);
  *m_new = top;
  *rowsum = sum;
}

std::vector<mx::array> softmax_step(const mx::array& s, const mx::array& m, int L, int q_start, int k_start,
                                    int window, mx::StreamOrDevice stream) {
  if (s.dtype() != mx::float32 || m.dtype() != mx::float32 || s.ndim() < 2)
    throw std::invalid_argument("softmax_step: s and m must be float32, s [..., rows, n]");
  auto row_shape = s.shape();
  row_shape.back() = 1;
  if (m.shape() != row_shape) throw std::invalid_argument("softmax_step: m must be s's shape with a last axis of 1");
  if (L <= 0 || s.shape(-2) % L != 0) throw std::invalid_argument("softmax_step: s's rows must be a multiple of L");
  return mx::array::make_arrays({s.shape(), row_shape, row_shape, row_shape},
                                {mx::float32, mx::float32, mx::float32, mx::float32},
                                std::make_shared<SoftmaxStep>(mx::to_stream(stream), BlockMask{L, q_start, k_start, window}), {s, m});
}

void SoftmaxStep::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = begin_cpu(stream(), inputs, outputs);
  const auto& s = inputs[0];
  encoder.dispatch([sr = RowMajor{s}, mr = RowMajor{inputs[1]}, p = outputs[0].data<float>(),
                    corr = outputs[1].data<float>(), m_new = outputs[2].data<float>(),
                    rowsum = outputs[3].data<float>(), n = s.shape(-1), rows = s.size() / s.shape(-1),
                    per = s.shape(-2), mask = mask_]() mutable {
    const float* sp = sr.data<float>();
    const float* mp = mr.data<float>();
#pragma omp parallel for schedule(static) if (static_cast<long>(rows) * n >= (1 << 16))
    for (long r = 0; r < static_cast<long>(rows); ++r) {
      int lo, hi;
      visible_run(mask.qpos(r % per), mask.k_start, mask.window, n, lo, hi);
      step_row(sp + r * n, p + r * n, lo, hi, n, mp[r], corr + r, m_new + r, rowsum + r);
    }
  });
}

void SoftmaxStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFit's softmax_step runs on the CPU only (on Metal, KVExec's MLX path is used)");
}

bool SoftmaxStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const SoftmaxStep&>(other);
  return mask_ == o.mask_;
}

}  // namespace justfit

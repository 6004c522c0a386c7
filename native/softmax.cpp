// See softmax.h. Per row: the max, exp(x - max) written out while summed, then one
// scaling pass. With AVX2 the exponential is simd.h's vector polynomial.
#include "softmax.h"

#include <cmath>
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

}  // namespace justfit

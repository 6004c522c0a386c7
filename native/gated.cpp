// See gated.h. sigmoid and tanh both come from exp of a non-positive argument (simd.h):
// sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below, e = exp(-|x|); tanh(z) =
// sign(z) (1 - e) / (1 + e), e = exp(-2 |z|). Elements are split across threads.
#include "gated.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "simd.h"
#include "stored.h"

namespace justfit {

namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;

inline float act(float x, int kind) {
  if (kind == kSilu) {
    const float e = std::exp(-std::fabs(x));
    return x * (x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
  }
  const float z = kGeluScale * (x + kGeluCube * x * x * x), e = std::exp(-2.f * std::fabs(z));
  return 0.5f * x * (1.f + std::copysign((1.f - e) / (1.f + e), z));
}

#ifdef __AVX2__
inline __m256 act8(__m256 x, int kind) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  if (kind == kSilu) {
    const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));  // exp(-|x|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_mul_ps(x, _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, positive));
  }
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(kGeluScale), _mm256_fmadd_ps(_mm256_set1_ps(kGeluCube), cube, x));
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_or_ps(z, sign)));  // exp(-2|z|)
  __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  t = _mm256_or_ps(t, _mm256_and_ps(z, sign));  // tanh takes z's sign
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
}
#endif

void gate(const float* g, const float* u, float* y, size_t n, int kind) {
  size_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(act8(_mm256_loadu_ps(g + i), kind), _mm256_loadu_ps(u + i)));
#endif
  for (; i < n; ++i) y[i] = act(g[i], kind) * u[i];
}

}  // namespace

void gated(const float* g, const float* u, float* y, size_t n, int kind) {
  constexpr size_t kSpan = 1 << 14;
  const long spans = static_cast<long>((n + kSpan - 1) / kSpan);
#pragma omp parallel for schedule(static) if (spans > 1)
  for (long k = 0; k < spans; ++k) {
    const size_t at = static_cast<size_t>(k) * kSpan;
    gate(g + at, u + at, y + at, std::min(kSpan, n - at), kind);
  }
}

mx::array gated_activation(const mx::array& gate, const mx::array& up, int kind, mx::StreamOrDevice s) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape())
    throw std::invalid_argument("gated_activation: gate and up must be float32 of one shape");
  if (kind != kSilu && kind != kGeluApprox)
    throw std::invalid_argument("gated_activation: kind must be 0 (silu) or 1 (gelu_approx)");
  return mx::array(gate.shape(), mx::float32, std::make_shared<GatedActivation>(mx::to_stream(s), kind), {gate, up});
}

void GatedActivation::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  encoder.dispatch([g = RowMajor{inputs[0]}, u = RowMajor{inputs[1]}, yp = y.data<float>(), n = y.size(),
                    kind = kind_]() mutable { gated(g.data<float>(), u.data<float>(), yp, n, kind); });
}

void GatedActivation::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFitGatedActivation runs on the CPU only (on Metal, mlx-lm's compiled one is used)");
}

}  // namespace justfit

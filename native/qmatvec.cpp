// See qmatvec.h. Each output column o reads its weight row once and forms the dot
// product with every input row (at most kRows at a time, so their partial sums stay in
// registers): the weights cost the same for 1 row as for 8. Columns of the output are
// split across threads (OpenMP), which MLX's CPU stream thread runs. With AVX2 the
// quantized values are widened in registers and each group's products summed as
// vectors; the portable path unpacks each group to floats first. Rounded (int8 or
// int16) activations: qmatvec_int.cpp.
#include "qmatvec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "gated.h"
#include "qmatvec_int.h"
#include "rms_norm.h"
#include "simd.h"
#include "stored.h"
#include "unpack.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace justfit {

namespace {

// Rows per pass over a column: each row keeps four chains (below), so two rows fill the registers.
constexpr int kRows = 2;


// The sum of x over each group of each row: the biases' share of every dot product.
std::vector<float> group_sums(const float* x, int rows, int in, int group_size) {
  const int groups = in / group_size;
  std::vector<float> sums(static_cast<size_t>(rows) * groups);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int j = 0; j < group_size; ++j) s += x[r * in + g * group_size + j];
      sums[r * groups + g] = s;
    }
  return sums;
}

#ifdef __AVX2__
// Output column `o` for NR input rows: the group's dot products stay in vector
// registers (ACC independent chains per row, so one row is not bound by the FMA's
// latency), scaled once per group and summed across lanes once per column. ACC is the
// same for every NR: a row's product does not depend on how many rows share the call.
template <int Bits, int NR, typename S>
inline void column(const float* x, int in, const uint8_t* wrow, const S* sc, const S* bi, const float* xsum,
                   int groups, int group_size, float* y, int out, std::vector<float>& scales) {
  constexpr int ACC = 4;
  if (scales.size() < static_cast<size_t>(groups)) scales.resize(groups);
  widen_scales(sc, groups, scales.data());
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m256 dot[NR][ACC];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < ACC; ++k) dot[r][k] = _mm256_setzero_ps();
    const int base = g * group_size;
    for (int c = 0; c < group_size; c += 32) {
      __m256 q[4];
      floats32<Bits>(wrow + (base + c) * Bits / 8, q);
      for (int r = 0; r < NR; ++r) {
        const float* xr = x + static_cast<size_t>(r) * in + base + c;
        for (int k = 0; k < 4; ++k) dot[r][k % ACC] = _mm256_fmadd_ps(q[k], _mm256_loadu_ps(xr + 8 * k), dot[r][k % ACC]);
      }
    }
    const __m256 scale = _mm256_broadcast_ss(scales.data() + g);
    for (int r = 0; r < NR; ++r) {
      __m256 d = dot[r][0];
      for (int k = 1; k < ACC; ++k) d = _mm256_add_ps(d, dot[r][k]);
      acc[r] = _mm256_fmadd_ps(d, scale, acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    y[static_cast<size_t>(r) * out] = hsum(acc[r]) + bias_share(bi, sc, 0.f, xsum + static_cast<size_t>(r) * groups, groups);
}

// Output column `o` for `nr` (<= kRows) input rows: the vector path per row count.
template <int Bits, typename S>
inline void columns(const float* x, int in, const uint8_t* wrow, const S* sc, const S* bi, const float* xs,
                    int groups, int group_size, float* y, int out, int nr, std::vector<float>& scales) {
  if (nr == 1)
    column<Bits, 1>(x, in, wrow, sc, bi, xs, groups, group_size, y, out, scales);
  else
    column<Bits, 2>(x, in, wrow, sc, bi, xs, groups, group_size, y, out, scales);
}
#else
// Portable: each group unpacked to floats, then dotted with every row.
template <int Bits, typename S>
inline void columns(const float* x, int in, const uint8_t* wrow, const S* sc, const S* bi, const float* xs,
                    int groups, int group_size, float* y, int out, int nr, std::vector<float>&) {
  alignas(32) float q[256];
  float acc[kRows] = {0.f};
  for (int g = 0; g < groups; ++g) {
    unpack_group<Bits>(wrow + g * group_size * Bits / 8, q, group_size);
    const float scale = static_cast<float>(sc[g]), bias = static_cast<float>(bi[g]);
    for (int r = 0; r < nr; ++r) {
      const float* xr = x + static_cast<size_t>(r) * in + g * group_size;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int j = 0; j < group_size; ++j) dot += q[j] * xr[j];
      acc[r] += scale * dot + bias * xs[r * groups + g];
    }
  }
  for (int r = 0; r < nr; ++r) y[static_cast<size_t>(r) * out] = acc[r];
}
#endif

template <int Bits, typename S>
void matvec(const float* x, const uint8_t* w, const S* scales, const S* biases, float* y,
            int rows, int in, int out, int group_size) {
  const int groups = in / group_size;
  const int row_bytes = in * Bits / 8;
  const std::vector<float> sums = group_sums(x, rows, in, group_size);
#pragma omp parallel
  {
    std::vector<float> room;  // a column's scales as floats
#pragma omp for schedule(static)
    for (int o = 0; o < out; ++o) {
      const uint8_t* wrow = w + static_cast<size_t>(o) * row_bytes;
      const S* sc = scales + static_cast<size_t>(o) * groups;
      const S* bi = biases + static_cast<size_t>(o) * groups;
      if (o + kColumnsAhead < out) prefetch_column(wrow, row_bytes, sc, bi, groups);
      for (int r0 = 0; r0 < rows; r0 += kRows)
        columns<Bits>(x + static_cast<size_t>(r0) * in, in, wrow, sc, bi, sums.data() + static_cast<size_t>(r0) * groups,
                      groups, group_size, y + static_cast<size_t>(r0) * out + o, out,
                      rows - r0 < kRows ? rows - r0 : kRows, room);
    }
  }
}


}  // namespace

namespace {

// out, after checking one weight's arrays against x (and the settings).
int checked_out(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                int group_size, int bits) {
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    throw std::invalid_argument("quantized_matvec: scales and biases must both be float16 or both float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || scales.ndim() != 2)
    throw std::invalid_argument("quantized_matvec: w must be a 2-D uint32 array");
  int out = w.shape(0), in = w.shape(1) * 32 / bits;
  if (x.shape(-1) != in || scales.shape(0) != out || scales.shape(1) != in / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("quantized_matvec: shapes do not agree");
  return out;
}

}  // namespace

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, int activation_bits,
                           mx::StreamOrDevice s) {
  return quantized_matvecs(x, {w}, {scales}, {biases}, group_size, std::vector<int>{bits}, activation_bits, {}, s)[0];
}

std::vector<mx::array> quantized_matvecs(const mx::array& x, const std::vector<mx::array>& w,
                                         const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                         int group_size, const std::vector<int>& bits, int activation_bits,
                                         const MatvecFusion& fusion, mx::StreamOrDevice s) {
  if (bits.size() != w.size()) throw std::invalid_argument("quantized_matvec: one bit width per weight");
  for (int b : bits)
    if (!matvec_width(b)) throw std::invalid_argument("quantized_matvec: bits must be 4, 5, 6 or 8");
  if (group_size % 32 != 0 || group_size > 256)
    throw std::invalid_argument("quantized_matvec: group_size must be a multiple of 32, at most 256");
  if (x.dtype() != mx::float32)
    throw std::invalid_argument("quantized_matvec: x must be float32");
  if (activation_bits != 32 && !rounded_activations(activation_bits))
    throw std::invalid_argument("quantized_matvec: activation_bits must be 32 (float32), 16 or 8");
  if (activation_bits != 32 && !rounded_available())
    throw std::invalid_argument("quantized_matvec: rounded activations need AVX2 (this build computes float32 only)");
  if (w.empty() || scales.size() != w.size() || biases.size() != w.size())
    throw std::invalid_argument("quantized_matvec: one scales and biases per weight, at least one weight");
  // No Contiguous nodes here: four per call were a fifth of a decode step's graph. An
  // input that is not row-contiguous when computed is copied in eval_cpu instead.
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < w.size(); ++i) {
    if (scales[i].dtype() != scales[0].dtype())
      throw std::invalid_argument("quantized_matvec: every weight's scales must share a dtype");
    auto shape = x.shape();
    shape.back() = checked_out(x, w[i], scales[i], biases[i], group_size, bits[i]);
    shapes.push_back(shape);
    inputs.insert(inputs.end(), {w[i], scales[i], biases[i]});
  }
  const int out = shapes[0].back();
  const bool single = fusion.gate >= 0 || w.size() == 1;
  if (fusion.gate >= 0) {
    if (fusion.gate != kSilu && fusion.gate != kGeluApprox) throw std::invalid_argument("quantized_matvec: unknown gate");
    if (w.size() != 2 || shapes[1] != shapes[0])
      throw std::invalid_argument("quantized_matvec: a gate takes two weights of one shape");
    shapes.resize(1);
  }
  if ((fusion.post_norm || fusion.residual) && !single)
    throw std::invalid_argument("quantized_matvec: post_norm and residual need a single output");
  auto vector_of = [](const std::optional<mx::array>& a, int n, const char* what) {
    if (a && (a->dtype() != mx::float32 || a->ndim() != 1 || a->shape(0) != n))
      throw std::invalid_argument(std::string("quantized_matvec: ") + what + " must be a float32 vector of its width");
  };
  vector_of(fusion.norm, x.shape(-1), "norm");
  vector_of(fusion.post_norm, out, "post_norm");
  if (fusion.residual && (fusion.residual->dtype() != mx::float32 || fusion.residual->shape() != shapes[0]))
    throw std::invalid_argument("quantized_matvec: residual must be float32 of the output's shape");
  for (auto* a : {&fusion.norm, &fusion.post_norm, &fusion.residual})
    if (*a) inputs.push_back(**a);
  const QuantizedMatvec::Steps steps{fusion.norm.has_value(), fusion.post_norm.has_value(), fusion.residual.has_value(),
                                     fusion.norm_eps, fusion.norm_offset, fusion.gate};
  auto stream = mx::to_stream(s);
  const size_t outputs = shapes.size();
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(outputs, mx::float32),
                                std::make_shared<QuantizedMatvec>(stream, group_size, bits, activation_bits, steps),
                                inputs);
}

void QuantizedMatvec::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& encoder = begin_cpu(stream(), inputs, outputs);
  const int in = x.shape(-1), rows = x.size() / in;
  const int gs = group_size_, activation_bits = activation_bits_;
  const std::vector<int> widths = widths_;
  const Steps steps = steps_;
  const bool half = inputs[2].dtype() == mx::float16;
  const size_t products = widths.size();
  std::vector<RowMajor> weights;  // w, scales, biases of each product in turn
  for (size_t i = 1; i <= 3 * products; ++i) weights.push_back(RowMajor{inputs[i]});
  std::vector<RowMajor> extra;    // the fusion's arrays, in Steps' order
  for (size_t i = 1 + 3 * products; i < inputs.size(); ++i) extra.push_back(RowMajor{inputs[i]});
  float* y0 = outputs[0].data<float>();
  std::vector<float*> ys;
  for (auto& y : outputs) ys.push_back(y.data<float>());
  // One operation for several products of the same x (a layer's q, k, v): MLX's dispatch
  // is paid once, and x is read (and rounded) for each in turn.
  encoder.dispatch([=, xs = RowMajor{x}, weights = std::move(weights), extra = std::move(extra)]() mutable {
    size_t next = 0;
    const float* norm_w = steps.norm ? extra[next++].data<float>() : nullptr;
    const float* post_w = steps.post_norm ? extra[next++].data<float>() : nullptr;
    const float* residual = steps.residual ? extra[next++].data<float>() : nullptr;
    const float* xp = xs.data<float>();
    std::vector<float> normed;
    if (norm_w) {
      normed.resize(static_cast<size_t>(rows) * in);
      for (int r = 0; r < rows; ++r)
        rms_norm_row(xp + static_cast<size_t>(r) * in, norm_w, normed.data() + static_cast<size_t>(r) * in, in,
                     steps.eps, steps.offset);
      xp = normed.data();
    }
    const int out0 = weights[0].a.shape(0);
    std::vector<float> pair;  // the two products a gate combines
    if (steps.gate >= 0) {
      pair.resize(2 * static_cast<size_t>(rows) * out0);
      ys = {pair.data(), pair.data() + static_cast<size_t>(rows) * out0};
    }
    std::vector<RoundedProduct> rounded;
    for (size_t k = 0; k < products; ++k) {
      const uint8_t* wp = weights[3 * k].data<uint8_t>();
      const uint8_t* sp = weights[3 * k + 1].data<uint8_t>();
      const uint8_t* bp = weights[3 * k + 2].data<uint8_t>();
      const int out = weights[3 * k].a.shape(0), bits = widths[k];
      if (activation_bits != 32) {
        rounded.push_back({wp, sp, bp, ys[k], out, bits});
        continue;
      }
      with_stored<4, 5, 6, 8>(bits, half, sp, bp, [&]<int B>(auto* ss, auto* bs) {
        matvec<B>(xp, wp, ss, bs, ys[k], rows, in, out, gs);
      });
    }
    if (!rounded.empty()) matvecs_rounded(xp, rounded, half, rows, in, gs, activation_bits);
    const size_t n = static_cast<size_t>(rows) * out0;
    if (steps.gate >= 0) gated(ys[0], ys[1], y0, n, steps.gate);
    if (post_w)
      for (int r = 0; r < rows; ++r)
        rms_norm_row(y0 + static_cast<size_t>(r) * out0, post_w, y0 + static_cast<size_t>(r) * out0, out0, steps.eps,
                     steps.offset);
    if (residual)
      for (size_t i = 0; i < n; ++i) y0[i] = residual[i] + y0[i];
  });
}

}  // namespace justfit

// See dequantize.h. Each row's groups: the values unpacked 32 at a time, times the
// group's scale plus its bias (one FMA per 8), rows split with OpenMP.
#include "dequantize.h"

#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "qmatvec.h"
#include "simd.h"
#include "unpack.h"

namespace justfit {

namespace {

// One row's `in` values (groups of group_size) into y.
template <int Bits, typename S>
inline void dequantize_row(const uint8_t* wr, const S* scales, const S* biases, float* yr, int in, int group_size) {
  const int groups = in / group_size;
  for (int g = 0; g < groups; ++g) {
    const float scale = widen(scales, g), bias = widen(biases, g);
    const int base = g * group_size;
#ifdef __AVX2__
    const __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(bias);
    for (int c = 0; c < group_size; c += 32) {
      __m256 q[4];
      floats32<Bits>(wr + static_cast<int64_t>(base + c) * Bits / 8, q);
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(yr + base + c + 8 * k, _mm256_fmadd_ps(q[k], s, b));
    }
#else
    unpack_group<Bits>(wr + static_cast<int64_t>(base) * Bits / 8, yr + base, group_size);
    for (int j = 0; j < group_size; ++j) yr[base + j] = yr[base + j] * scale + bias;
#endif
  }
}

template <int Bits, typename S>
void dequantize_rows(const uint8_t* w, const S* scales, const S* biases, float* y, int64_t rows, int in,
                     int group_size) {
  const int groups = in / group_size;
  const int64_t row_bytes = static_cast<int64_t>(in) * Bits / 8;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row<Bits>(w + r * row_bytes, scales + r * groups, biases + r * groups, y + r * in, in, group_size);
}

}  // namespace

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     mx::StreamOrDevice s) {
  if (!dequantize_width(bits)) throw std::invalid_argument("dequantize: bits must be 2, 3, 4, 5, 6 or 8");
  if (group_size % 32 != 0) throw std::invalid_argument("dequantize: group_size must be a multiple of 32");
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    throw std::invalid_argument("dequantize: scales and biases must both be float16 or both float32");
  if (w.dtype() != mx::uint32 || w.ndim() < 1 || scales.shape() != biases.shape() || scales.ndim() != w.ndim())
    throw std::invalid_argument("dequantize: w must be uint32, scales and biases of its rank and one shape");
  auto shape = w.shape();
  shape.back() = w.shape(-1) * 32 / bits;
  for (int d = 0; d + 1 < w.ndim(); ++d)
    if (scales.shape(d) != w.shape(d)) throw std::invalid_argument("dequantize: shapes do not agree");
  if (scales.shape(-1) * group_size != shape.back()) throw std::invalid_argument("dequantize: shapes do not agree");
  return mx::array(shape, mx::float32, std::make_shared<Dequantize>(mx::to_stream(s), group_size, bits),
                   {w, scales, biases});
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  const int in = y.shape(-1), bits = bits_, group_size = group_size_;
  const bool half = inputs[1].dtype() == mx::float16;
  encoder.dispatch([w = RowMajor{inputs[0]}, sc = RowMajor{inputs[1]}, bi = RowMajor{inputs[2]}, yp = y.data<float>(),
                    rows = static_cast<int64_t>(y.size() / in), in, bits, group_size, half]() mutable {
    const uint8_t* wp = w.data<uint8_t>();
    with_stored<2, 3, 4, 5, 6, 8>(bits, half, sc.data<uint8_t>(), bi.data<uint8_t>(), [&]<int B>(auto* s, auto* b) {
      dequantize_rows<B>(wp, s, b, yp, rows, in, group_size);
    });
  });
}

mx::array dequantize_channels(const std::vector<mx::array>& w, const std::vector<mx::array>& scales,
                              const std::vector<mx::array>& biases, const std::vector<mx::array>& columns,
                              int group_size, const std::vector<int>& bits, int head_dim, mx::StreamOrDevice s) {
  const size_t parts = w.size();
  if (parts == 0 || scales.size() != parts || biases.size() != parts || bits.size() != parts ||
      (columns.empty() ? parts != 1 : columns.size() != parts))
    throw std::invalid_argument("dequantize_channels: one w, scales, biases and bits (and columns) per part");
  if (group_size % 32 != 0) throw std::invalid_argument("dequantize_channels: group_size must be a multiple of 32");
  const int T = w[0].ndim() == 4 ? w[0].shape(3) * 32 / bits[0] : 0;
  int channels = 0;
  std::vector<mx::array> inputs;
  for (size_t i = 0; i < parts; ++i) {
    if (!dequantize_width(bits[i]))
      throw std::invalid_argument("dequantize_channels: bits must be 2, 3, 4, 5, 6 or 8");
    if (w[i].dtype() != mx::uint32 || w[i].ndim() != 4 || scales[i].shape() != biases[i].shape() ||
        scales[i].ndim() != 4 || scales[i].dtype() != biases[i].dtype() || scales[i].dtype() != scales[0].dtype() ||
        (scales[i].dtype() != mx::float16 && scales[i].dtype() != mx::float32))
      throw std::invalid_argument("dequantize_channels: w uint32 [B, kv_heads, n, T * bits / 32], scales and biases "
                                  "[B, kv_heads, n, T / group_size] of one float dtype");
    const int n = w[i].shape(2);
    if (w[i].shape(0) != w[0].shape(0) || w[i].shape(1) != w[0].shape(1) || w[i].shape(3) * 32 / bits[i] != T ||
        scales[i].shape(0) != w[i].shape(0) || scales[i].shape(1) != w[i].shape(1) || scales[i].shape(2) != n ||
        scales[i].shape(3) * group_size != T)
      throw std::invalid_argument("dequantize_channels: the parts' shapes do not agree");
    if (!columns.empty() && (columns[i].dtype() != mx::int32 || columns[i].shape() != mx::Shape{w[i].shape(1), n}))
      throw std::invalid_argument("dequantize_channels: columns must be int32 [kv_heads, n]");
    channels += n;
    inputs.insert(inputs.end(), {w[i], scales[i], biases[i]});
    if (!columns.empty()) inputs.push_back(columns[i]);
  }
  if (channels != head_dim)
    throw std::invalid_argument("dequantize_channels: the parts' channels must sum to head_dim");
  return mx::array({w[0].shape(0), w[0].shape(1), T, head_dim}, mx::float32,
                   std::make_shared<DequantizeChannels>(mx::to_stream(s), group_size, bits, !columns.empty()),
                   inputs);
}

void DequantizeChannels::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  const int per = columns_ ? 4 : 3, parts = static_cast<int>(inputs.size()) / per;
  const int lead = y.shape(0) * y.shape(1), kvh = y.shape(1), T = y.shape(2), D = y.shape(3);
  std::vector<RowMajor> arrays;
  for (const auto& a : inputs) arrays.push_back(RowMajor{a});
  encoder.dispatch([arrays = std::move(arrays), bits = bits_, group_size = group_size_, per, parts, lead, kvh, T, D,
                    half = inputs[1].dtype() == mx::float16, yp = y.data<float>()]() mutable {
    std::vector<int> offsets{0};  // each part's first channel among all (rows = lead x channels)
    for (int p = 0; p < parts; ++p) offsets.push_back(offsets.back() + arrays[p * per].a.shape(2));
    std::vector<const uint8_t*> w(parts), sc(parts), bi(parts);
    std::vector<const int32_t*> cols(parts, nullptr);
    for (int p = 0; p < parts; ++p) {
      w[p] = arrays[p * per].data<uint8_t>();
      sc[p] = arrays[p * per + 1].data<uint8_t>();
      bi[p] = arrays[p * per + 2].data<uint8_t>();
      if (per == 4) cols[p] = arrays[p * per + 3].data<int32_t>();
    }
    // A task is one leading index's group of tokens: every channel's group unpacked into
    // a [head_dim, group] tile (in cache), then written out token by token (contiguous rows).
    const int groups = T / group_size;
#pragma omp parallel
    {
      std::vector<float> tile(static_cast<size_t>(D) * group_size);
#pragma omp for schedule(static)
      for (int64_t task = 0; task < static_cast<int64_t>(lead) * groups; ++task) {
        const int l = static_cast<int>(task / groups), g = static_cast<int>(task % groups);
        for (int p = 0; p < parts; ++p) {
          const int n = offsets[p + 1] - offsets[p];
          for (int i = 0; i < n; ++i) {
            const int64_t at = static_cast<int64_t>(l) * n + i;  // the channel's row within its part
            const int column = cols[p] ? cols[p][static_cast<int64_t>(l % kvh) * n + i] : i;
            with_stored<2, 3, 4, 5, 6, 8>(bits[p], half, sc[p], bi[p], [&]<int B>(auto* s, auto* b) {
              const uint8_t* wr =
                  w[p] + at * (static_cast<int64_t>(T) * B / 8) + static_cast<int64_t>(g) * group_size * B / 8;
              float* row = tile.data() + static_cast<size_t>(column) * group_size;
              dequantize_row<B>(wr, s + at * groups + g, b + at * groups + g, row, group_size, group_size);
            });
          }
        }
        float* out = yp + (static_cast<int64_t>(l) * T + static_cast<int64_t>(g) * group_size) * D;
        for (int t = 0; t < group_size; ++t)
          for (int d = 0; d < D; ++d)
            out[static_cast<int64_t>(t) * D + d] = tile[static_cast<size_t>(d) * group_size + t];
      }
    }
  });
}

void DequantizeChannels::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFitDequantizeChannels runs on the CPU only (on Metal, MLX's dequantize is used)");
}

bool DequantizeChannels::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DequantizeChannels&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && columns_ == o.columns_;
}

}  // namespace justfit

// See decode_attention.h. Scores go into one buffer [kv rows, queries, all keys] (each
// block's columns at its offset), the softmax runs over each row in place, and each
// block's probabilities, read where they lie, weight its values. Quantized blocks use the
// page product (page_product.cpp) on their storage; full-precision blocks (sinks, the
// hot window) are plain loops: they are short.
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "full_block.h"
#include "page_product.h"
#include "softmax.h"
#include "stored.h"

namespace justfit {

namespace {

constexpr int kQuantizedHead = 10;  // a quantized block's ints before its parts' widths

// Copies made where an input cannot be read in place (kept until the kernel returns).
using Copies = std::vector<std::vector<uint8_t>>;

template <typename T>
const T* row_major(const mx::array& a, Copies& copies) {
  RowMajor r{a};
  const T* p = r.data<T>();
  if (!r.copy.empty()) copies.push_back(std::move(r.copy));  // the buffer moves with it
  return p;
}

// Rows of D values: in place where the strides allow (a slice of the hot window), else a copy.
template <typename T>
FullRows<T> full_rows(const mx::array& a, Copies& copies) {
  if (auto st = in_place_strides(a)) return {a.data<T>(), st->first, st->second};
  return {row_major<T>(a, copies), a.shape(-1), static_cast<int64_t>(a.shape(-2)) * a.shape(-1)};
}

// A full block's scores or values product on its rows as stored (float32 or float16).
void full_block_scores(const float* q, const mx::array& k, bool half, Copies& copies, int batch, int R, int D,
                       int n, float* s, int ld) {
  if (half) full_scores(q, full_rows<mx::float16_t>(k, copies), batch, R, D, n, s, ld);
  else full_scores(q, full_rows<float>(k, copies), batch, R, D, n, s, ld);
}
void full_block_values(const float* p, const mx::array& v, bool half, Copies& copies, int batch, int R, int D,
                       int n, int ld, float* acc) {
  if (half) full_values(p, full_rows<mx::float16_t>(v, copies), batch, R, D, n, ld, acc);
  else full_values(p, full_rows<float>(v, copies), batch, R, D, n, ld, acc);
}

// A stored part read in place, or from row-major copies of its arrays where not.
Part part_of(const mx::array& w, const mx::array& scales, const mx::array& biases, int bits, int group_size,
             const int32_t* columns, Copies& copies) {
  if (auto p = stored_part(w, scales, biases, bits, group_size, columns)) return *p;
  const int stride = w.shape(-1) * 32 / bits, rows = w.shape(-2);
  return Part{row_major<uint8_t>(w, copies), row_major<uint8_t>(scales, copies), row_major<uint8_t>(biases, copies),
              bits, rows, columns, stride, rows};
}

// One block as its spec gives it, and where its arrays start among the inputs.
struct Block {
  int kind, start, length, first;
  int key_group = 0, value_bits = 0, value_group = 0, parts = 0;
  bool key_rotated = false, value_rotated = false, columns = false;
  bool half = false;  // quantized: scales and biases in float16; full: the tokens themselves
  std::vector<int> widths;
};

// x [D] times R [D, D]: out[e] = sum_d x[d] R[d, e], vectorized over e.
void turn(const float* x, const float* R, int D, float* out) {
  for (int e = 0; e < D; ++e) out[e] = 0.f;
  for (int d = 0; d < D; ++d)
    for (int e = 0; e < D; ++e) out[e] += x[d] * R[static_cast<size_t>(d) * D + e];
}

// -inf where key `start + t` is not visible to the row's query: later than it, or (window
// > 0) `window` or more positions earlier.
void mask(float* s, int length, int start, int qpos, int window) {
  for (int t = 0; t < length; ++t) {
    const int kpos = start + t;
    if (kpos > qpos || (window > 0 && qpos - kpos >= window)) s[t] = -std::numeric_limits<float>::infinity();
  }
}

struct Shape {
  int batch, kv_heads, rows, L, D;
  bool tokens_major;  // the output [B, L, H * D] instead of [B, H, L, D]
};

// Where row i (leading index i / rows, row i % rows) of the output starts.
size_t output_row(size_t i, const Shape& sh) {
  if (!sh.tokens_major) return i * sh.D;
  const size_t lead = i / sh.rows, r = i % sh.rows, rep = sh.rows / sh.L;
  const size_t b = lead / sh.kv_heads, h = lead % sh.kv_heads * rep + r / sh.L, l = r % sh.L;
  return ((b * sh.L + l) * sh.kv_heads * rep + h) * sh.D;
}

void attend(const float* q, const std::vector<mx::array>& in, const std::vector<Block>& blocks,
            const float* rotation, const Shape& sh, int q_start, float scale, int window, float* y) {
  Copies copies;
  const int batch = sh.batch, R = sh.rows, D = sh.D, L = sh.L;
  const size_t nrows = static_cast<size_t>(batch) * R;
  std::vector<float> qs(nrows * D), qr;
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q[i] * scale;
  int total = 0;
  bool any_key_rotated = false, any_value_rotated = false;
  for (const auto& b : blocks) {
    total += b.length;
    any_key_rotated |= b.kind == kQuantized && b.key_rotated;
    any_value_rotated |= b.kind == kQuantized && b.value_rotated;
  }
  if (any_key_rotated) {
    qr.resize(qs.size());
    for (size_t i = 0; i < nrows; ++i)
      turn(qs.data() + i * D, rotation + static_cast<size_t>(i / R % sh.kv_heads) * D * D, D, qr.data() + i * D);
  }
  std::vector<float> scores(nrows * total);
  int offset = 0;
  for (const auto& b : blocks) {
    float* s = scores.data() + offset;
    if (b.kind == kFull) {
      // the hot window holds up to two pages of positions in full precision: at a short
      // context most of the arithmetic, so on both cores
      full_block_scores(qs.data(), in[b.first], b.half, copies, batch, R, D, b.length, s, total);
    } else {
      std::vector<Part> parts;
      for (int p = 0, i = b.first; p < b.parts; ++p, i += b.columns ? 4 : 3)
        parts.push_back(part_of(in[i], in[i + 1], in[i + 2], b.widths[p], b.key_group,
                                b.columns ? in[i + 3].data<int32_t>() : nullptr, copies));
      product(b.key_rotated ? qr.data() : qs.data(), parts, b.half, s, batch, sh.kv_heads, R, D, b.length,
              b.key_group, total);
    }
    const bool all_visible = b.start + b.length - 1 <= q_start && (window <= 0 || q_start + L - 1 - b.start < window);
    if (!all_visible)
      for (size_t i = 0; i < nrows; ++i) mask(s + i * total, b.length, b.start, q_start + static_cast<int>(i % R) % L, window);
    offset += b.length;
  }
  // Each row's softmax runs from its first visible key to its last (the keys outside, a
  // window's older blocks and the chunk's later positions, get 0): a row's sums then run
  // over the keys a decode step at its position would see, in the same order, so its
  // result does not depend on the rows (or blocks) beside it.
  std::vector<int> begins(L, -1), ends(L, 0);
  for (int l = 0; l < L; ++l) {
    const int qpos = q_start + l;
    int at = 0;
    for (const auto& b : blocks) {
      const int first = window > 0 ? std::max(0, qpos - window + 1 - b.start) : 0;
      const int last = std::min(b.length, qpos - b.start + 1);  // one past the last visible
      if (first < last) {
        if (begins[l] < 0) begins[l] = at + first;
        ends[l] = at + last;
      }
      at += b.length;
    }
    if (begins[l] < 0) begins[l] = 0;
  }
#pragma omp parallel for schedule(static) if (nrows * total >= (1 << 16))
  for (long i = 0; i < static_cast<long>(nrows); ++i) {
    float* row = scores.data() + i * total;
    const int l = (i % R) % L, begin = begins[l], end = std::max(begins[l], ends[l]);
    softmax_row(row + begin, row + begin, end - begin);
    std::fill(row, row + begin, 0.f);
    std::fill(row + end, row + total, 0.f);
  }
  std::vector<float> plain(nrows * D, 0.f), turned(any_value_rotated ? nrows * D : 0, 0.f), part(nrows * D);
  offset = 0;
  for (const auto& b : blocks) {
    const float* p = scores.data() + offset;
    if (b.kind == kFull) {
      full_block_values(p, in[b.first + 1], b.half, copies, batch, R, D, b.length, total, plain.data());
    } else {
      const int i = b.first + b.parts * (b.columns ? 4 : 3);
      Part values = part_of(in[i], in[i + 1], in[i + 2], b.value_bits, b.value_group, nullptr, copies);
      values.rows = b.length;  // the storage holds more tokens than are written
      product(p, {values}, b.half, part.data(), batch, sh.kv_heads, R, total, D, b.value_group, D);
      float* acc = b.value_rotated ? turned.data() : plain.data();
      for (size_t i = 0; i < part.size(); ++i) acc[i] += part[i];
    }
    offset += b.length;
  }
  // Turning back multiplies by R^T, given as its own matrix: the forward turn by it is
  // vectorized over outputs, where a sum over d of R's rows is a dependent chain each.
  const float* back_turn = rotation ? rotation + static_cast<size_t>(sh.kv_heads) * D * D : nullptr;
  std::vector<float> back(D);
  for (size_t i = 0; i < nrows; ++i) {
    float* out = y + output_row(i, sh);
    std::memcpy(out, plain.data() + i * D, D * sizeof(float));
    if (!any_value_rotated) continue;
    turn(turned.data() + i * D, back_turn + static_cast<size_t>(i / R % sh.kv_heads) * D * D, D, back.data());
    for (int d = 0; d < D; ++d) out[d] += back[d];
  }
}

int block_arrays(const std::vector<int>& spec) {
  if (spec.empty()) throw std::invalid_argument("decode_attention: an empty block");
  if (spec[0] == kFull) {
    if (spec.size() != 3) throw std::invalid_argument("decode_attention: a full block is {0, start, length}");
    return 2;
  }
  if (spec[0] != kQuantized || spec.size() < kQuantizedHead + 1 ||
      spec.size() != static_cast<size_t>(kQuantizedHead + spec[9]))
    throw std::invalid_argument("decode_attention: a quantized block is {1, start, length, key_group, key_rotated, "
                                "value_bits, value_group, value_rotated, key_columns, parts, bits...}");
  return spec[9] * (spec[8] ? 4 : 3) + 3;
}

}  // namespace

mx::array decode_attention(const mx::array& queries, const std::vector<mx::array>& arrays,
                           const std::vector<std::vector<int>>& blocks, int q_start, float scale, int window,
                           const std::optional<mx::array>& rotation, bool tokens_major, mx::StreamOrDevice s) {
  if (queries.dtype() != mx::float32 || queries.ndim() != 4)
    throw std::invalid_argument("decode_attention: queries must be float32 [B, H, L, D]");
  if (blocks.empty()) throw std::invalid_argument("decode_attention: no block");
  size_t need = 0;
  for (const auto& b : blocks) need += block_arrays(b);
  if (need != arrays.size()) throw std::invalid_argument("decode_attention: the arrays do not match the blocks");
  const int B = queries.shape(0), H = queries.shape(1), D = queries.shape(3), kvh = arrays[0].shape(1);
  if (kvh <= 0 || H % kvh) throw std::invalid_argument("decode_attention: heads must be a multiple of kv_heads");
  size_t at = 0;
  for (const auto& b : blocks) {
    const int n = block_arrays(b);
    for (int i = 0; i < n; ++i) {
      const auto& a = arrays[at + i];
      const bool columns = b[0] == kQuantized && b[8] && i < b[9] * 4 && i % 4 == 3;
      if (columns ? (a.dtype() != mx::int32 || a.ndim() != 2 || a.shape(0) != kvh)
                  : (a.ndim() != 4 || a.shape(0) != B || a.shape(1) != kvh))
        throw std::invalid_argument("decode_attention: a block's arrays must be [B, kv_heads, ...] like the queries'");
    }
    if (b[0] == kFull && ((arrays[at].dtype() != mx::float32 && arrays[at].dtype() != mx::float16) ||
                          arrays[at + 1].dtype() != arrays[at].dtype() || arrays[at].shape(-1) != D ||
                          arrays[at].shape(-2) < b[2] || arrays[at + 1].shape(-2) < b[2]))
      throw std::invalid_argument("decode_attention: a full block's keys and values must be float32 or float16 "
                                  "alike, [B, kv_heads, >= length, D]");
    at += n;
  }
  if (rotation && (rotation->dtype() != mx::float32 || rotation->shape() != mx::Shape{2, kvh, D, D}))
    throw std::invalid_argument("decode_attention: rotation must be float32 [2, kv_heads, D, D]: R and R^T");
  std::vector<mx::array> inputs{queries};
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  if (rotation) inputs.push_back(*rotation);
  auto stream = mx::to_stream(s);
  const int L = queries.shape(2);
  auto shape = tokens_major ? mx::Shape{B, L, H * D} : queries.shape();
  return mx::array(shape, mx::float32,
                   std::make_shared<DecodeAttention>(stream, blocks, q_start, scale, window, rotation.has_value(),
                                                     tokens_major),
                   inputs);
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& encoder = begin_cpu(stream(), inputs, y);
  const auto& q = inputs[0];
  Shape sh{0, inputs[1].shape(1), 0, q.shape(2), q.shape(3), tokens_major_};
  sh.batch = q.shape(0) * sh.kv_heads;
  sh.rows = q.shape(1) / sh.kv_heads * sh.L;
  std::vector<Block> blocks;
  int at = 1;
  for (const auto& spec : blocks_) {
    Block b{spec[0], spec[1], spec[2], at};
    if (b.kind == kFull) b.half = inputs[at].dtype() == mx::float16;  // stored tokens, not scales
    if (b.kind == kQuantized) {
      b.key_group = spec[3], b.key_rotated = spec[4], b.value_bits = spec[5], b.value_group = spec[6];
      b.value_rotated = spec[7], b.columns = spec[8], b.parts = spec[9];
      b.widths.assign(spec.begin() + kQuantizedHead, spec.end());
      b.half = inputs[at + 1].dtype() == mx::float16;
      const int values = at + b.parts * (b.columns ? 4 : 3);
      if ((inputs[values + 1].dtype() == mx::float16) != b.half)
        throw std::runtime_error("decode_attention: a block's keys and values must store scales alike");
    }
    at += block_arrays(spec);
    blocks.push_back(std::move(b));
  }
  const float* rotation = rotation_ ? inputs.back().data<float>() : nullptr;
  encoder.dispatch([=, qs = RowMajor{q}, blocks = std::move(blocks), yp = y.data<float>(), q_start = q_start_,
                    scale = scale_, window = window_]() mutable {
    attend(qs.data<float>(), inputs, blocks, rotation, sh, q_start, scale, window, yp);
  });
}

void DecodeAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("JustFitDecodeAttention runs on the CPU only (on Metal, KVExec's MLX path is used)");
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecodeAttention&>(other);
  return blocks_ == o.blocks_ && q_start_ == o.q_start_ && scale_ == o.scale_ && window_ == o.window_ &&
         rotation_ == o.rotation_ && tokens_major_ == o.tokens_major_;
}

}  // namespace justfit

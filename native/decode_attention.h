// Decode attention over a layer's KV pages as one MLX operation: every block scored on
// its stored form, one softmax over all the scores, every block's values weighted and
// summed, in a single primitive. The same arithmetic as kvexec/attention.py's two-pass
// path (which makes 20-30 operations a layer of it: at decode on the CPU each costs
// MLX's dispatch, more than the arithmetic at short contexts).
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace justfit {

namespace mx = mlx::core;

// What one block is, as decode_attention's `blocks` entries give it (ints):
//   full:      {0, start, length}; arrays: keys, values [B, kv_heads, >= length, D], float32
//              or float16 alike
//   quantized: {1, start, length, key_group, key_rotated, value_bits, value_group,
//               value_rotated, key_columns, parts, bits_1 .. bits_parts}; arrays: per key
//              part w, scales, biases (and its columns [kv_heads, rows] int32 where
//              key_columns), then the values' w, scales, biases: a segment's storage
//              (MLX's transpose=False layouts, keys per channel [.., rows, tokens], values
//              per token [.., tokens, D]), of which the first `length` tokens are read.
// `start` is the block's first position.
enum BlockKind { kFull = 0, kQuantized = 1 };

// softmax(q K^T * scale + mask) V over the blocks for queries [B, H, L, D] float32 at
// positions q_start .. q_start + L - 1 (causal; `window` > 0: keys older than that many
// positions are masked too), H a multiple of the blocks' kv_heads. `rotation`
// [2, kv_heads, D, D]: the rotation R of rotated keys (q turns by it) and its transpose
// (rotated values' weighted sum turns back by R^T), both as the caller keeps them (a
// transpose made here each call was most of a layer's turning back). Returns
// [B, H, L, D] float32, or with `tokens_major` [B, L, H * D] (what the layer's output
// projection takes).
mx::array decode_attention(const mx::array& queries, const std::vector<mx::array>& arrays,
                           const std::vector<std::vector<int>>& blocks, int q_start, float scale, int window,
                           const std::optional<mx::array>& rotation, bool tokens_major = false,
                           mx::StreamOrDevice s = {});

class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream stream, std::vector<std::vector<int>> blocks, int q_start, float scale, int window,
                  bool rotation, bool tokens_major)
      : mx::Primitive(stream), blocks_(std::move(blocks)), q_start_(q_start), scale_(scale), window_(window),
        rotation_(rotation), tokens_major_(tokens_major) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  const char* name() const override { return "JustFitDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<std::vector<int>> blocks_;
  int q_start_;
  float scale_;
  int window_;
  bool rotation_;
  bool tokens_major_;
};

}  // namespace justfit

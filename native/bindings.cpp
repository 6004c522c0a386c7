// Python bindings of JustFit's native kernels (module justfit_native._ext).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "attention_fold.h"
#include "decode_attention.h"
#include "dequantize.h"
#include "gated.h"
#include "heads.h"
#include "qmatmul_rows.h"
#include "qmatvec.h"
#include "qmatvec_int.h"
#include "rms_norm.h"
#include "rope.h"
#include "softmax.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "JustFit's native kernels for MLX's CPU backend";
  m.def("quantized_matvec", &justfit::quantized_matvec, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "activation_bits"_a = 32, "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T for MLX's affine-quantized weights (4, 5, 6 or 8 bits), float32; "
        "activation_bits 8 or 16: x's blocks of 32 rounded to int8 or int16 and multiplied in integers (AVX2).");
  m.def(
      "quantized_matvecs",
      [](const mx::array& x, const std::vector<mx::array>& w, const std::vector<mx::array>& scales,
         const std::vector<mx::array>& biases, int group_size, const std::vector<int>& bits, int activation_bits,
         std::optional<mx::array> norm, std::optional<mx::array> post_norm, std::optional<mx::array> residual,
         float norm_eps, float norm_offset, int gate, mx::StreamOrDevice s) {
        return justfit::quantized_matvecs(x, w, scales, biases, group_size, bits, activation_bits,
                                          {norm, post_norm, residual, norm_eps, norm_offset, gate}, s);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a, nb::kw_only(), "activation_bits"_a = 32,
      "norm"_a = nb::none(), "post_norm"_a = nb::none(), "residual"_a = nb::none(), "norm_eps"_a = 0.f,
      "norm_offset"_a = 0.f, "gate"_a = -1, "stream"_a = nb::none(),
      "quantized_matvec of one x with several weights (same in and group_size; bits: one per weight) as one "
      "operation: a list. Fused steps (qmatvec.h MatvecFusion): x RMS-normed by `norm` first; `gate` 0 (silu) "
      "or 1 (gelu_approx): two products become [act(y0) * y1]; the single output RMS-normed by `post_norm`, "
      "then `residual` added (norms: weight + norm_offset, norm_eps).");
  m.def("dequantize_channels", &justfit::dequantize_channels, "w"_a, "scales"_a, "biases"_a, "columns"_a,
        "group_size"_a, "bits"_a, "head_dim"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Keys stored per channel (each part's channels at columns[i]) back as float32 [B, kv_heads, T, head_dim].");
  m.def("dequantize", &justfit::dequantize, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a, nb::kw_only(),
        "stream"_a = nb::none(), "mx.dequantize in float32 for MLX's affine 2- to 6- and 8-bit weights, on both cores.");
  m.def("attention_fold", &justfit::attention_fold, "q"_a, "k"_a, "v"_a, "m"_a, "l"_a, "acc"_a, "L"_a, "q_start"_a,
        "k_start"_a, "window"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Prefill's online softmax attention over one float32 block of keys, folded: [m, l, acc] (attention_fold.h).");
  m.attr("ROUNDED_ACTIVATIONS") = justfit::rounded_available() ? nb::make_tuple(8, 16) : nb::make_tuple();
  m.def("rope", &justfit::rope, "x"_a, "inv_freqs"_a, "dims"_a, nb::kw_only(), "traditional"_a, "scale"_a, "offset"_a,
        "stream"_a = nb::none(), "mx.fast.rope for float32 x on the CPU, as one operation.");
  m.def("rms_norm", &justfit::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(), "weight_offset"_a = 0.f,
        "stream"_a = nb::none(),
        "mx.fast.rms_norm(x, weight + weight_offset, eps) for float32 x and weight on the CPU, as one operation.");
  m.def("quantized_matmul_rows", &justfit::quantized_matmul_rows, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases) (MLX's transpose=False layout) for a few rows, float32.");
  m.def("quantized_matmul_rows_split", &justfit::quantized_matmul_rows_split, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "columns"_a, "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "sum over parts of x[..., columns[i][head]] @ dequantize(part i) (MLX's transpose=False layout), float32.");
  m.def("softmax", &justfit::softmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.softmax(x, axis=-1, precise=True) for float32 x on the CPU, with vectorized exponentials.");
  m.def("decode_attention", &justfit::decode_attention, "queries"_a, "arrays"_a, "blocks"_a, "q_start"_a, "scale"_a,
        "window"_a, "rotation"_a = nb::none(), nb::kw_only(), "tokens_major"_a = false, "stream"_a = nb::none(),
        "softmax(q K^T * scale + mask) V over a layer's KV blocks (full or quantized pages) as one operation.");
  m.def("rope_heads", &justfit::rope_heads, "q"_a, "k"_a, "v"_a, "heads"_a, "kv_heads"_a, "inv_freqs"_a, "dims"_a,
        nb::kw_only(), "traditional"_a, "scale"_a, "offset"_a, "norms"_a = nb::none(), "norm_eps"_a = 0.f,
        "norm_offset"_a = 0.f, "stream"_a = nb::none(),
        "q, k, v [B, L, heads * D] -> [B, heads, L, D] each, q and k (RMS-normed per head first where norms = "
        "(q_weight, k_weight) are given) rotated as rope does: one operation.");
  m.def("gated_activation", &justfit::gated_activation, "gate"_a, "up"_a, "kind"_a, nb::kw_only(),
        "stream"_a = nb::none(), "silu(gate) * up (kind 0) or gelu_approx(gate) * up (kind 1), float32, one operation.");
  m.def("softmax_step", &justfit::softmax_step, "s"_a, "m"_a, "L"_a, "q_start"_a, "k_start"_a, "window"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "One block of prefill's online softmax, masked: [p, corr, m_new, rowsum] (see native/softmax.h).");
  m.attr("ROWS_BITS") = nb::make_tuple(2, 3, 4, 5, 6, 8);  // the widths quantized_matmul_rows reads
  m.attr("MATVEC_BITS") = nb::make_tuple(4, 5, 6, 8);       // the widths quantized_matvec reads
  m.attr("DEQUANTIZE_BITS") = nb::make_tuple(2, 3, 4, 5, 6, 8);  // the widths dequantize reads
}

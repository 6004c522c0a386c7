"""Named policies: which form each phase uses. The choice between backends lives
here, not in model code."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class ResidencyPolicy:
    """How weights are held and used: the resident form, how prefill runs, and parameter precision."""

    name: str
    resident: str  # the form components keep between phases: q8t | stored | dense
    prefill: str  # how prefill runs each layer: dense (materialized just in time) | resident | measured
    fp32: bool  # cast float parameters to fp32 (MLX's CPU kernels are far slower on fp16)
    summary: str


POLICIES = {p.name: p for p in (
    ResidencyPolicy("cpu", "q8t", "dense", True,
           "decode on q8t weights (8-bit, [in,out] layout: MLX's fastest CPU matvec); prefill "
           "materializes each layer in fp32 just in time for a BLAS GEMM and releases it"),
    ResidencyPolicy("cpu-native", "native", "dense", True,
           "decode on the stored quantized weights through JustFit's native CPU kernel "
           "(native/, built by ./dev): the stored bytes, read once per step for every row "
           "of a batch; q8t where the kernel cannot compute a layer; prefill dense just in time"),
    ResidencyPolicy("cpu-int16", "native-int16", "dense", True,
           "cpu-native with int16 activations: each product rounds its input's blocks of 32 to "
           "int16 and multiplies in integers (AVX2: fewer instructions per weight than float32; "
           "rounding about 1e-5 of a block's largest value); the same stored bytes"),
    ResidencyPolicy("cpu-int8", "native-int8", "dense", True,
           "cpu-native with int8 activations, as llama.cpp computes its quantized weights (AVX2: "
           "the fewest instructions per weight; rounding about 0.4% of a block's largest value, "
           "which tips near ties); the same stored bytes"),
    ResidencyPolicy("cpu-exact", "grouped", "dense", True,
           "the stored quantization exactly in every phase: decode on its integer grid "
           "regrouped for MLX's fast CPU matvec (1.5 bytes/weight); prefill dense just in time"),
    ResidencyPolicy("cpu-compact", "stored", "dense", True,
           "decode on the stored quantized weights with fp32 activations (about half cpu's "
           "resident bytes, slower decode); prefill dense just in time: for tight budgets"),
    ResidencyPolicy("dense", "dense", "resident", True,
           "every weight resident in fp32: no per-chunk dequantization, 4-8x the memory"),
    ResidencyPolicy("quantized", "stored", "resident", False,
           "stored quantized weights in every phase (Metal's quantized kernels)"),
    ResidencyPolicy("measured", "stored", "measured", False,
           "stored weights; per layer shape, prefill uses dense or stored, whichever a probe "
           "chunk measured faster"),
)}


def default_policy() -> str:
    """The policy `auto` means here: quantized on a GPU; on the CPU the native kernel where
    it is built (the stored weights exactly, fewer bytes and faster decode than q8t), with
    int16 activations where it multiplies them (cpu-int16: greedy parity and perplexity
    against llama.cpp equal to cpu-native's, `python -m bench.parity --policy`), cpu
    otherwise. Not cpu-int8: its rounding tips near ties (SmolLM2 answers "What is the
    capital of France?" with "L'Étoile" where float32 or int16 activations give "The
    capital of France is Paris": logits 25.33 vs 25.24)."""
    if mx.default_device() == mx.gpu:
        return "quantized"
    from phaseswap.native import available, rounded_available

    if not available():
        return "cpu"
    return "cpu-int16" if rounded_available() else "cpu-native"


def get_policy(name: str | None) -> ResidencyPolicy:
    """The policy `name` names (None or "auto": the default); ValueError for an unknown one."""
    name = default_policy() if name in (None, "auto") else name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose auto or one of {', '.join(POLICIES)}")
    return POLICIES[name]

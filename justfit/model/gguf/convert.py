"""Convert a GGUF file into an mlx-lm model folder (config.json, model.safetensors,
tokenizer files), cached on disk so the second start is fast.

Precision (`RequantOptions.bits`):
- "native" (default): every type whose values are 32-weight affine groups (Q4_0, Q4_1,
  Q8_0, Q5_0, Q5_1, Q4_K, Q5_K) is translated into MLX's affine format bit for bit;
  the others (Q6_K, Q2_K, Q3_K, IQ*) are dequantized with the `gguf` package and
  re-quantized at 8 bits (docs/BENCHMARKS.md has its parity with llama.cpp).
- "exact": the same, but the non-affine types stay dense fp32, so every weight equals
  llama.cpp's dequantized value.
- 2..8: everything but Q4_0/Q4_1/Q8_0 re-quantized at that width (`embed_bits` for the
  embedding). Compact but lossy twice (re-quantized from an already quantized file).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from justfit.model.gguf.blocks import EXACT_TYPES, GROUP, to_mlx_affine
from justfit.model.gguf.options import CONVERTER_VERSION, RequantOptions, UnsupportedModel
from justfit.model.gguf.file import GGUFTensor, read_gguf
from justfit.model.gguf.tokenizer import build_tokenizer, tokenizer_config
from justfit.model import bytelevel, sentencepiece

_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
_NATIVE = (QT.Q4_0, QT.Q4_1, QT.Q8_0)  # what mx.load reads natively


# GGUF tensor suffix -> mlx-lm module path (per layer unless global).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}


def _field(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def _base_config(meta: dict[str, Any], arch: str, tied: bool) -> dict[str, Any]:
    heads = _field(meta, arch, "attention.head_count")
    hidden = _field(meta, arch, "embedding_length")
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": _field(meta, arch, "block_count"),
        "intermediate_size": _field(meta, arch, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(meta, arch, "attention.head_count_kv", heads),
        "head_dim": _field(meta, arch, "attention.key_length", hidden // heads),
        "rms_norm_eps": _field(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": _field(meta, arch, "rope.freq_base", 10000.0),
        "max_position_embeddings": _field(meta, arch, "context_length", 4096),
        "tie_word_embeddings": tied,
    }
    if _field(meta, arch, "rope.scaling.type") not in (None, "none"):
        raise UnsupportedModel(f"{arch}: RoPE scaling in GGUF is not supported yet")
    return cfg


def _config_llama(meta, tied):
    # llama.cpp permutes Q/K rows for interleaved RoPE; run it that way instead of
    # un-permuting, which keeps the weights bit-exact.
    return {**_base_config(meta, "llama", tied), "model_type": "llama", "rope_traditional": True}


def _config_qwen(arch: str) -> Callable:
    def build(meta, tied):
        return {**_base_config(meta, arch, tied), "model_type": arch}

    return build


def _config_gemma3(meta, tied):
    cfg = _base_config(meta, "gemma3", tied)
    hidden, heads, head_dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    # llama.cpp: 1/sqrt(head_dim) except the 27B, which scales by hidden/heads.
    scalar = hidden // heads if cfg["num_hidden_layers"] == 62 else head_dim
    cfg.update(
        model_type="gemma3_text",
        query_pre_attn_scalar=scalar,
        sliding_window=_field(meta, "gemma3", "attention.sliding_window", 512),
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
    )
    cfg.pop("tie_word_embeddings")
    return cfg


_ARCHS: dict[str, tuple[Callable, dict[str, str], bool]] = {
    # arch: (config builder, layer tensor names, norms stored as 1 + w)
    "llama": (_config_llama, _LAYER_NAMES, False),
    "qwen2": (_config_qwen("qwen2"), _LAYER_NAMES, False),
    "qwen3": (_config_qwen("qwen3"), _LAYER_NAMES, False),
    "gemma3": (_config_gemma3, _GEMMA3_LAYER_NAMES, True),
}


def _mlx_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, suffix = base.split(".", 2)
        target = layer_names.get(suffix)
        return f"model.layers.{idx}.{target}.{kind}" if target else None
    target = _GLOBAL_NAMES.get(base)
    return f"{target}.{kind}" if target else None


def _tensor_arrays(tensor: GGUFTensor, name: str, opts: RequantOptions, norm_offset: bool):
    """(arrays keyed by weight/scales/biases, quantization dict or None)."""
    import mlx.core as mx

    qtype = QT(tensor.tensor_type)
    is_embedding = name.startswith("model.embed_tokens")
    if qtype in _FLOAT_TYPES:
        arr = np.asarray(tensor.data)
        if qtype == QT.BF16:
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        if norm_offset and name.endswith("norm.weight"):
            arr = arr.astype(np.float32) - 1.0
        return {"weight": arr}, None
    if qtype in _NATIVE or (opts.bits in ("exact", "native") and qtype in EXACT_TYPES):
        arrays, bits = to_mlx_affine(tensor.data, qtype)
        return arrays, {"group_size": GROUP, "bits": bits}
    dense = dequantize(np.asarray(tensor.data), qtype).astype(np.float32)
    if opts.bits == "exact":  # no 32-group affine form (Q6_K, Q2_K, Q3_K, IQ*): dense
        return {"weight": dense}, None
    if is_embedding:
        bits = opts.embed_bits
    else:
        bits = 8 if opts.bits == "native" else int(opts.bits)
    w, scales, biases = mx.quantize(mx.array(dense), group_size=GROUP, bits=bits)
    out = {
        "weight": np.array(w),
        "scales": np.array(scales.astype(mx.float16)),
        "biases": np.array(biases.astype(mx.float16)),
    }
    return out, {"group_size": GROUP, "bits": bits}


def _arch(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModel(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(sorted(_ARCHS))})"
        )
    return arch


def header_config(meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The mlx-lm config the converter writes for a file of this metadata and these tensor names."""
    return _ARCHS[_arch(meta)][0](meta, "output.weight" not in names)


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, opts: RequantOptions) -> Path:
    """Write an mlx-lm model folder for `gguf_path` into `out_dir` (atomically)."""
    import mlx.core as mx

    meta, tensors = read_gguf(str(gguf_path))
    arch = _arch(meta)
    meta["context_length"] = meta.get(f"{arch}.context_length")
    _, layer_names, norm_offset = _ARCHS[arch]
    config = header_config(meta, {t.name for t in tensors})

    weights: dict[str, Any] = {}
    quant: dict[str, Any] = {}
    for tensor in tensors:
        target = _mlx_name(tensor.name, layer_names)
        if target is None:
            if tensor.name == "rope_freqs.weight":
                raise UnsupportedModel(f"{arch}: per-frequency RoPE factors are not supported yet")
            continue
        module = target.rsplit(".", 1)[0]
        if not target.endswith(".weight"):
            weights[target] = mx.array(np.asarray(tensor.data))
            tensor.drop_pages()
            continue
        arrays, q = _tensor_arrays(tensor, target, opts, norm_offset)
        # converted: the file's bytes, then each numpy form once in MLX, need not stay
        # (a large vocabulary's embedding held all three at once)
        tensor.drop_pages()
        for kind in list(arrays):
            weights[f"{module}.{kind}"] = mx.array(arrays.pop(kind))
        if q:
            quant[module] = q
    if quant:
        # mlx-lm reads one default plus per-module overrides.
        default = max({(q["bits"], q["group_size"]) for q in quant.values()},
                      key=lambda bq: sum(q == {"bits": bq[0], "group_size": bq[1]} for q in quant.values()))
        config["quantization"] = {"group_size": default[1], "bits": default[0]}
        config["quantization"].update(
            {m: q for m, q in quant.items() if (q["bits"], q["group_size"]) != default}
        )
    config["justfit"] = {
        "source": os.path.basename(str(gguf_path)),
        "converter_version": CONVERTER_VERSION,
        "requant": asdict(opts),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        # written: the tokenizer's build below, and the model's load after, need not sit
        # on top of them or of MLX's cache of their buffers
        del weights, tensors
        mx.clear_cache()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
        # JustFit loads these compact forms, not tokenizer.json (kept for mlx-lm's loader)
        if meta.get("tokenizer.ggml.model") == "llama":
            sentencepiece.write_vocabulary(tmp / sentencepiece.FILE_NAME, meta)
        elif meta.get("tokenizer.ggml.model") == "gpt2":
            bytelevel.write_vocabulary(tmp / bytelevel.FILE_NAME, meta)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

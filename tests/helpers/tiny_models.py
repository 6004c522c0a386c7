"""Tiny random-weight models for fast mechanism tests: GGUF files written with the
`gguf` package (as llama.cpp would lay them out) and mlx-lm model folders."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from mlx_lm.utils import _get_classes

def in_memory_model(config: dict, float32: bool = True):
    """An mlx-lm model of `config` (its "model_type" included) with random weights drawn
    from seed 0, in memory; `float32`: every parameter cast to float32 and evaluated."""
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if float32:
        model.apply(lambda a: a.astype(mx.float32))
        mx.eval(model.parameters())
    return model


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def gpt2_vocab() -> dict:
    """Byte-level BPE vocabulary: specials, 256 bytes, and a few merges."""
    byte_chars = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ s", "o n"]
    tokens = SPECIALS + byte_chars + [m.replace(" ", "") for m in merges]
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return {"model": "gpt2", "pre": "default", "tokens": tokens, "types": types, "merges": merges,
            "bos": 0, "eos": 2, "add_bos": False}


def spm_vocab() -> dict:
    """SentencePiece-style vocabulary with scores and byte fallback."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = list("\u2581abcdefghijklmnopqrstuvwxyz") + ["\u2581t", "he", "\u2581the", "in", "\u2581a", "er"]
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(TokenType.NORMAL)
        scores.append(-float(i))
    tokens.append("\n")
    types.append(TokenType.USER_DEFINED)
    scores.append(0.0)
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": scores,
            "bos": 2, "eos": 1, "unk": 3, "add_bos": True}


def _write_vocab(w: GGUFWriter, v: dict, template: str | None) -> None:
    w.add_tokenizer_model(v["model"])
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if "scores" in v:
        w.add_token_scores(v["scores"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    if "unk" in v:
        w.add_unk_token_id(v["unk"])
    w.add_add_bos_token(v["add_bos"])
    if template:
        w.add_chat_template(template)


def finish(w: GGUFWriter) -> None:
    """Write header, metadata and tensors, then close."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Valid raw blocks of `qtype` (random codes, sane fp16 scales) for a rows x cols matrix."""
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    # fp16 super-scales: where each type keeps them (d, and dmin for *_K with mins)
    offsets = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (nbytes - 2,), QT.Q5_0: (0,),
               QT.Q2_K: (nbytes - 4, nbytes - 2), QT.Q3_K: (nbytes - 2,)}[qtype]
    # K-quants multiply d by 6- or 8-bit sub-scales: keep weights near 0.05 either way.
    low, high = (0.001, 0.004) if qtype == QT.Q5_0 else (2e-5, 1e-4)
    for off in offsets:
        vals = rng.uniform(low, high, size=raw.shape[:2]).astype(np.float16)
        raw[..., off : off + 2] = vals[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(w: GGUFWriter, name: str, arr: np.ndarray, qtype: QT) -> np.ndarray:
    """Store `arr` as `qtype`; return what a reader dequantizes it to."""
    if qtype == QT.F32:
        w.add_tensor(name, arr.astype(np.float32))
        return arr.astype(np.float32)
    data = quantize(arr.astype(np.float32), qtype)
    w.add_tensor(name, data, raw_dtype=qtype)
    return dequantize(data, qtype)


def write_llama_gguf(path: Path, seed: int = 0, layers: int = 2) -> dict[str, np.ndarray]:
    """A tiny llama GGUF (Q8_0 embedding, Q4_0/Q4_1/Q8_0 matrices, permuted Q/K).
    Returns the HF-layout (unpermuted) float weights a reference model should use."""
    rng = np.random.default_rng(seed)
    vocab = gpt2_vocab()
    hidden, heads, kv_heads, ff = 64, 4, 2, 128
    head_dim = hidden // heads
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    _write_vocab(w, vocab, CHAT_TEMPLATE)
    ref: dict[str, np.ndarray] = {}
    n_vocab = len(vocab["tokens"])
    ref["model.embed_tokens.weight"] = _add(w, "token_embd.weight", rng.normal(0, 0.5, (n_vocab, hidden)), QT.Q8_0)
    ref["model.norm.weight"] = _add(w, "output_norm.weight", rng.uniform(0.8, 1.2, hidden), QT.F32)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = rng.normal(0, 0.2, (hidden, hidden))
        k = rng.normal(0, 0.2, (kv_heads * head_dim, hidden))
        ref[p + "self_attn.q_proj.weight"] = unpermute_from_gguf(
            _add(w, b + "attn_q.weight", permute_for_gguf(q, heads), QT.Q4_0), heads)
        ref[p + "self_attn.k_proj.weight"] = unpermute_from_gguf(
            _add(w, b + "attn_k.weight", permute_for_gguf(k, kv_heads), QT.Q4_1), kv_heads)
        ref[p + "self_attn.v_proj.weight"] = _add(w, b + "attn_v.weight", rng.normal(0, 0.2, (kv_heads * head_dim, hidden)), QT.Q8_0)
        ref[p + "self_attn.o_proj.weight"] = _add(w, b + "attn_output.weight", rng.normal(0, 0.2, (hidden, hidden)), QT.Q4_1)
        ref[p + "mlp.gate_proj.weight"] = _add(w, b + "ffn_gate.weight", rng.normal(0, 0.2, (ff, hidden)), QT.Q4_1)
        ref[p + "mlp.up_proj.weight"] = _add(w, b + "ffn_up.weight", rng.normal(0, 0.2, (ff, hidden)), QT.Q8_0)
        ref[p + "mlp.down_proj.weight"] = _add(w, b + "ffn_down.weight", rng.normal(0, 0.2, (hidden, ff)), QT.Q4_0)
        ref[p + "input_layernorm.weight"] = _add(w, b + "attn_norm.weight", rng.uniform(0.8, 1.2, hidden), QT.F32)
        ref[p + "post_attention_layernorm.weight"] = _add(w, b + "ffn_norm.weight", rng.uniform(0.8, 1.2, hidden), QT.F32)
    finish(w)
    ref["_config"] = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                          intermediate_size=ff, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          rms_norm_eps=1e-5, vocab_size=n_vocab, rope_theta=10000.0,
                          max_position_embeddings=256, tie_word_embeddings=True)
    return ref


def write_gemma3_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny Gemma 3 GGUF: 6 layers (5 sliding, 1 global), K-quants and Q5_0, norms
    stored as 1 + w as llama.cpp's converter writes them."""
    rng = np.random.default_rng(seed)
    vocab = spm_vocab()
    hidden, heads, kv_heads, head_dim, ff, layers = 256, 4, 1, 64, 512, 6
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(8)
    _write_vocab(w, vocab, None)
    n_vocab = len(vocab["tokens"])
    ref: dict[str, np.ndarray] = {}

    def add_raw(name, qtype, rows, cols):
        data = random_blocks(rng, qtype, rows, cols)
        w.add_tensor(name, data, raw_dtype=qtype)
        return dequantize(data, qtype)

    def add_norm(name, n):
        stored = rng.uniform(0.9, 1.3, n).astype(np.float32)  # = 1 + w
        w.add_tensor(name, stored)
        return stored - 1.0

    ref["model.embed_tokens.weight"] = _add(w, "token_embd.weight", rng.normal(0, 0.05, (n_vocab, hidden)), QT.Q8_0)
    ref["model.norm.weight"] = add_norm("output_norm.weight", hidden)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        ref[p + "self_attn.q_proj.weight"] = add_raw(b + "attn_q.weight", QT.Q5_0, heads * head_dim, hidden)
        ref[p + "self_attn.k_proj.weight"] = add_raw(b + "attn_k.weight", QT.Q5_0, kv_heads * head_dim, hidden)
        ref[p + "self_attn.v_proj.weight"] = _add(w, b + "attn_v.weight", rng.normal(0, 0.05, (kv_heads * head_dim, hidden)), QT.Q8_0)
        ref[p + "self_attn.o_proj.weight"] = add_raw(b + "attn_output.weight", QT.Q4_K, hidden, heads * head_dim)
        ref[p + "mlp.gate_proj.weight"] = add_raw(b + "ffn_gate.weight", QT.Q4_K, ff, hidden)
        ref[p + "mlp.up_proj.weight"] = add_raw(b + "ffn_up.weight", QT.Q5_0, ff, hidden)
        ref[p + "mlp.down_proj.weight"] = add_raw(b + "ffn_down.weight", QT.Q6_K, hidden, ff)
        for gguf_name, mlx_name, n in [
            ("attn_norm", "input_layernorm", hidden), ("post_attention_norm", "post_attention_layernorm", hidden),
            ("ffn_norm", "pre_feedforward_layernorm", hidden), ("post_ffw_norm", "post_feedforward_layernorm", hidden),
            ("attn_q_norm", "self_attn.q_norm", head_dim), ("attn_k_norm", "self_attn.k_norm", head_dim),
        ]:
            ref[p + mlx_name + ".weight"] = add_norm(f"{b}{gguf_name}.weight", n)
    finish(w)
    ref["_config"] = dict(model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=layers,
                          intermediate_size=ff, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=head_dim, rms_norm_eps=1e-6, vocab_size=n_vocab, rope_theta=1_000_000.0,
                          rope_local_base_freq=10000.0, query_pre_attn_scalar=head_dim, sliding_window=8,
                          sliding_window_pattern=6, max_position_embeddings=1024)
    return ref


def reference_model(ref: dict[str, np.ndarray]):
    """An mlx-lm model of ref["_config"] holding exactly the float weights in `ref`."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = dict(ref["_config"])
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {k: mx.array(v.astype(np.float32)) for k, v in ref.items() if not k.startswith("_")}
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def write_mlx_folder(path: Path, model_type: str = "llama", seed: int = 0, quantize_bits: int | None = None,
                     layers: int | None = None, vocab_size: int | None = None, head_dim: int | None = None,
                     sliding_window: int | None = None) -> Path:
    """A tiny random mlx-lm model folder (llama, gemma3_text or qwen3_next) with a byte-level
    tokenizer and chat template, loadable by mlx-lm and the engine. `vocab_size` may
    pad the embedding past the tokenizer (as real models do); `head_dim` (llama: 16)
    of 32 or more lets quantized page formats store its keys (smaller ones keep fp16)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from justfit.model.gguf.tokenizer import build_tokenizer, tokenizer_config

    v = gpt2_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": v["tokens"], "tokenizer.ggml.token_type": [int(t) for t in v["types"]],
            "tokenizer.ggml.merges": v["merges"], "tokenizer.ggml.bos_token_id": v["bos"],
            "tokenizer.ggml.eos_token_id": v["eos"], "tokenizer.chat_template": CHAT_TEMPLATE,
            "context_length": 512}
    n_vocab = vocab_size or len(v["tokens"])
    if model_type == "llama":
        config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      vocab_size=n_vocab, rope_theta=10000.0, max_position_embeddings=512,
                      tie_word_embeddings=True)
    elif model_type == "qwen3_next":  # hybrid: GatedDeltaNet (recurrent) and attention layers
        config = dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      vocab_size=n_vocab, rope_theta=10000.0, max_position_embeddings=512,
                      linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                      num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=96,
                      mlp_only_layers=[0, 1, 2, 3], moe_intermediate_size=32, partial_rotary_factor=0.5,
                      full_attention_interval=2, tie_word_embeddings=True)
    else:
        config = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                      vocab_size=n_vocab, rope_theta=10000.0, rope_local_base_freq=10000.0,
                      query_pre_attn_scalar=32, sliding_window=16, sliding_window_pattern=6,
                      max_position_embeddings=512)
    if layers:
        config["num_hidden_layers"] = layers
    if head_dim:
        config["head_dim"] = head_dim
    if sliding_window and model_type == "gemma3_text":
        config["sliding_window"] = sliding_window
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.apply(lambda a: a * 4 if a.ndim == 2 else a)  # sharper logits than the default init
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer(meta).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta)))
    return path


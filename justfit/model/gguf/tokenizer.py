"""Build a Hugging Face `tokenizers` tokenizer from GGUF metadata.

Two vocabulary styles exist in GGUF files:
- `gpt2`: byte-level BPE with explicit merges; the pre-tokenizer regex is named by
  `tokenizer.ggml.pre` (llama.cpp's names).
- `llama`: SentencePiece-style BPE with per-piece scores and byte fallback; merges are
  derived from the scores (the pair whose merged piece scores highest merges first).
The result is saved as tokenizer.json + tokenizer_config.json, which mlx-lm loads.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

from justfit.model.bytelevel import PRE_TOKENIZERS
from justfit.model.vocabulary import CONTROL, NORMAL, USER_DEFINED


class UnsupportedTokenizer(ValueError):
    """GGUF tokenizer metadata this builder cannot turn into a tokenizer."""
    pass


def _gpt2_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(f"unsupported GGUF pre-tokenizer {pre!r}")
    pattern, digits = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []  # SmolLM isolates every digit first
    steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]):
    """Merges implied by SentencePiece BPE scores: best-scoring merged piece first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for this GGUF vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", kind == "llama"))

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
        tok.pre_tokenizer = _gpt2_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = list(meta["tokenizer.ggml.scores"])
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tok = Tokenizer(
            models.BPE(
                vocab,
                _spm_merges(tokens, scores, types),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        norm = [normalizers.Replace(" ", "\u2581")]
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            norm.insert(0, normalizers.Prepend("\u2581"))
            dec.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(dec)
    else:
        raise UnsupportedTokenizer(f"unsupported GGUF tokenizer model {kind!r}")

    # Control tokens are special (never produced by splitting text, skipped on
    # decode); user-defined ones are matched verbatim before BPE, as llama.cpp does.
    added = [
        AddedToken(t, special=types[i] == CONTROL, normalized=False)
        for i, t in enumerate(tokens)
        if types[i] in (CONTROL, USER_DEFINED)
    ]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
        )
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer_config.json that makes transformers/mlx-lm load it faithfully."""
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("context_length", 1 << 20)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}

"""A prompt too large for the context, refused from its size alone, before tokenizing.

No token covers more text than the vocabulary's longest token, so a text of N UTF-8
bytes is at least N / longest tokens; past context_limit x longest bytes it cannot
fit, whatever it tokenizes to. That is checked on the event loop in a millisecond
even for megabytes, where tokenizing them would take the tokenizer thread seconds
(and hold up every request queued behind). The bound holds only for tokenizers
that never drop text: a normalizer that strips or collapses characters, a
pre-tokenizer that removes whitespace, or an unknown-word token that swallows any
length would let a huge text be a few tokens; for those `longest_token_bytes`
answers None and nothing is refused by size. Normalizers that can only shrink text
by a bounded ratio (Unicode normalization forms, lowercasing) scale the bound by it."""

from __future__ import annotations

import json
import logging
import math

from justfit.server.schema import BadRequest

log = logging.getLogger("justfit.server")

# How many UTF-8 bytes of input one byte of normalized text can stand for, at most:
# e.g. NFKC maps a 4-byte mathematical letter to one ASCII byte, NFC U+1FEF (3 bytes)
# to U+0060, lowercasing the Kelvin sign (3 bytes) to "k".
SHRINK = {"Prepend": 1, "NFD": 3, "NFC": 3, "NFKD": 4, "NFKC": 4, "Lowercase": 3}
KEEPS_TEXT = ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")  # pre-tokenizers that drop nothing
SPLITTERS = ("Split", "Punctuation")  # drop nothing unless their behavior is "removed"


def longest_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of prompt text one token can stand for (the longest token,
    scaled by what normalization can shrink); None when the tokenizer may drop text
    (module doc) or is neither JustFit's own nor a `tokenizers` one."""
    own = getattr(getattr(tokenizer, "_tokenizer", None), "longest_token_bytes", None)
    if own is not None:  # a vocabulary held as arrays (justfit.model.vocabulary) answers itself
        longest = own()
        if longest is None:
            log.info("prompt size check off: this tokenizer may drop text, so size says nothing of length")
        return longest
    rust = _rust_tokenizer(tokenizer)
    if rust is None:
        log.info("prompt size check off: the tokenizer is not a `tokenizers` one")
        return None
    try:
        # Each part's own settings, one token at a time: the whole tokenizer as JSON (and
        # its vocabulary as a dict) would be a transient of several times its size.
        normalizer, pre = (None if part is None else json.loads(part.__getstate__())
                           for part in (rust.normalizer, rust.pre_tokenizer))
        shrink = _shrink(normalizer)
        if shrink is None or not _pre_keeps(pre) or not _model_keeps(_model_spec(rust.model)):
            log.info("prompt size check off: this tokenizer may drop text, so size says nothing of length")
            return None
        byte_level = _has(pre, "ByteLevel")
        added = {t.content for t in rust.get_added_tokens_decoder().values()}
        # Byte-level vocabularies spell each byte as one character; others are the text itself.
        # (Added tokens counted here too are counted again below, in bytes: the larger stands.)
        longest = max((len(t) if byte_level else len(t.encode("utf-8", "surrogatepass"))
                       for t in map(rust.id_to_token, range(rust.get_vocab_size())) if t is not None), default=1)
        longest = max([longest, 4, *(len(t.encode("utf-8", "surrogatepass")) for t in added)])  # 4: one character
        return math.ceil(longest * shrink)
    except (ValueError, KeyError, TypeError, AttributeError):  # a layout this code does not know: no check
        log.warning("prompt size check off: cannot read this tokenizer's layout", exc_info=True)
        return None


def _rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` inside JustFit's GGUF tokenizer or mlx-lm's wrapper."""
    from tokenizers import Tokenizer

    for holder in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        for candidate in (getattr(holder, "backend_tokenizer", None), holder):
            if isinstance(candidate, Tokenizer):
                return candidate
    return None


def _model_spec(model) -> dict:
    """The fields `_model_keeps` reads: a BPE model's from its attributes (its whole
    state holds the vocabulary and merges), any other's from its state."""
    if type(model).__name__ == "BPE":
        return {"type": "BPE", "byte_fallback": model.byte_fallback, "unk_token": model.unk_token,
                "fuse_unk": model.fuse_unk}
    return json.loads(model.__getstate__())


def _shrink(spec) -> float | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        parts = [_shrink(s) for s in spec.get("normalizers", [])]
        return None if None in parts else math.prod(parts)
    if kind == "Replace":  # a literal replaced by one at least as long only grows the text
        pattern = spec.get("pattern", {}).get("String")
        grows = pattern is not None and len(spec.get("content", "").encode()) >= len(pattern.encode())
        return 1 if grows else None
    return SHRINK.get(kind)


def _pre_keeps(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_keeps(s) for s in spec.get("pretokenizers", []))
    if kind in SPLITTERS:
        return str(spec.get("behavior", "")).lower() != "removed"
    return kind in KEEPS_TEXT


def _model_keeps(spec) -> bool:
    """Whether every character becomes at least one token (no fused unknown runs, no
    whole unknown words)."""
    kind = spec.get("type")
    if kind == "BPE":
        return bool(spec.get("byte_fallback")) or not (spec.get("unk_token") and spec.get("fuse_unk"))
    if kind == "Unigram":
        return bool(spec.get("byte_fallback"))
    return False


def _has(spec, kind: str) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has(s, kind) for s in spec.get("pretokenizers", []))
    return spec.get("type") == kind


def text_bytes(*values) -> int:
    """UTF-8 bytes of every string in `values` (nested in lists and dict values)."""
    total, stack = 0, list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, str):  # an ASCII string's length is its size: no copy
            total += len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


def refuse_oversized(context_limit: int, longest: int | None, *values, ids: int = 0,
                     param: str = "messages") -> None:
    """BadRequest (400 context_length_exceeded, with the numbers) when the text in
    `values` plus `ids` token ids cannot fit `context_limit` tokens at `longest` bytes
    a token at most; nothing when `longest` is None (no bound known)."""
    if longest is None:
        return
    most = max(0, context_limit - ids) * longest
    n = text_bytes(*values)
    if n <= most:
        return
    ids_too = f" beside {ids:,} token ids" if ids else ""
    details = {"prompt_bytes": n, "max_prompt_bytes": most, "context_limit": context_limit,
               "longest_token_bytes": longest}
    if ids:
        details["prompt_ids"] = ids
    raise BadRequest(f"the prompt is too long: {n:,} bytes of text{ids_too} cannot fit the {context_limit:,} "
                     f"tokens of this model's context (a token stands for {longest} bytes at most, so "
                     f"{most:,} bytes at most fit); shorten the prompt", param, 400,
                     "context_length_exceeded", "context_length_exceeded", details)

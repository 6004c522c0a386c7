"""Perplexity with llama.cpp's `llama-perplexity` protocol, so figures compare.

The text is tokenized once and cut into non-overlapping `ctx`-token chunks (a partial
last chunk is dropped); each chunk starts with BOS when the model adds one; only the
second half of each chunk is scored (logits at j predict token j+1, j >= ctx/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class PerplexityResult:
    """A perplexity and what it was computed over."""

    ppl: float
    chunks: int
    scored_tokens: int


def perplexity(model: nn.Module, tokens: list[int], ctx: int = 512, bos_id: int | None = None) -> PerplexityResult:
    """Perplexity of `model` on `tokens` by llama.cpp's protocol (see the module doc)."""
    n_chunks = len(tokens) // ctx
    if n_chunks == 0:
        raise ValueError(f"need at least {ctx} tokens, got {len(tokens)}")
    first = ctx // 2
    total_nll, scored = 0.0, 0
    for c in range(n_chunks):
        chunk = list(tokens[c * ctx : (c + 1) * ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        logits = model(mx.array(chunk)[None])[0, first : ctx - 1].astype(mx.float32)
        targets = mx.array(chunk[first + 1 : ctx])
        nll = nn.losses.cross_entropy(logits, targets, reduction="sum")
        total_nll += float(nll.item())
        scored += ctx - 1 - first
    return PerplexityResult(math.exp(total_nll / scored), n_chunks, scored)

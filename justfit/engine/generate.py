"""The forward passes: chunked prefill that computes logits only where they are used,
and a token's log-probabilities."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

import kvexec
from phaseswap.predict import transformer_body

ProgressFn = Callable[[int, int], None]  # (processed, total)


def _eval_cache(cache: list) -> None:
    mx.eval([c.state for c in cache])


def feed(model: nn.Module, tokens: list[int], cache: list) -> None:
    """Put `tokens` into `cache` through the transformer body only (no output head),
    evaluated."""
    body = transformer_body(model)
    (body if body is not None else model)(mx.array(tokens)[None], cache=cache)
    _eval_cache(cache)


def prefill(
    model: nn.Module,
    tokens: list[int],
    cache: list,
    chunk: int = 512,
    progress: ProgressFn | None = None,
    on_processed: Callable[[list[int]], None] | None = None,
    cut_at_pages: bool = False,
) -> mx.array:
    """Feed `tokens` into `cache`; return the logits (fp32, shape [vocab]) after the last.

    All but the last token go through the body only: the output head (vocab x hidden
    per position) would be wasted work and a large transient on every chunk.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    head, last = tokens[:-1], tokens[-1:]
    total = len(tokens)
    done = 0
    if progress:
        progress(0, total)
    while done < len(head):
        # `cut_at_pages`: a chunk stops short of a page flush, so a position's reply does not
        # depend on the chunk size (EngineConfig.deterministic).
        piece = head[done : done + (kvexec.chunk_room(cache, chunk) if cut_at_pages else chunk)]
        feed(model, piece, cache)
        done += len(piece)
        if on_processed:
            on_processed(piece)
        if progress:
            progress(done, total)
    logits = model(mx.array(last)[None], cache=cache)[0, -1].astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])  # decode starts from a finished state
    if on_processed:
        on_processed(last)
    if progress:
        progress(total, total)
    return logits


def token_logprobs(token: int, logprobs: mx.array, top: int) -> tuple[float, list[tuple[int, float]]]:
    """`token`'s log-probability and the `top` most likely (token, logprob), best first."""
    chosen = logprobs[token]
    if top <= 0:
        return float(chosen.item()), []
    idx = mx.argpartition(-logprobs, top - 1)[:top]
    values = logprobs[idx]
    mx.eval(chosen, idx, values)
    pairs = sorted(zip(idx.tolist(), values.tolist()), key=lambda p: -p[1])
    return float(chosen.item()), pairs

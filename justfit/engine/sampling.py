"""Token sampling with the request's own RNG keys.

A request's RNG position is two integers, `{"seed", "step"}`, stored with its state:
token `step` is drawn with a key derived from (seed, step) alone, so a restored
conversation samples exactly what the uninterrupted one would have, interleaved
requests do not disturb each other, and MLX's global RNG is never touched.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from justfit.config import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def new_rng(seed: int | None = None) -> dict:
    """A fresh RNG position: from `seed`, or from the OS when none is given."""
    return {"seed": int.from_bytes(os.urandom(4), "little") if seed is None else int(seed), "step": 0}


def step_key(seed: int, step: int) -> mx.array:
    """The key token `step` of a request seeded with `seed` is drawn with."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little") >> 1)  # a distinct key per (seed, step)


def keyed_sampler(sp: SamplingParams, vocab: int, rng: dict) -> Sampler:
    """mlx-lm's sampler chain (top-p, min-p, top-k, then temperature) drawing with the
    request's own keys; advances `rng["step"]` once per token drawn."""
    if sp.temperature == 0:
        return greedy_sampler
    filters = sampling_filters(sp, vocab)

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        key = step_key(rng["seed"], rng["step"])
        rng["step"] += 1
        return mx.random.categorical(logprobs * (1.0 / sp.temperature), key=key)

    return sample


def sampling_filters(sp: SamplingParams, vocab: int) -> list[Callable[[mx.array], mx.array]]:
    """The filters `keyed_sampler` applies, in its order: top-p, min-p, top-k."""
    top_k = sp.top_k if sp.top_k < vocab else 0  # keeping every token is no filter
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < sp.top_p < 1.0:
        filters.append(lambda x: top_p_filter(x, sp.top_p))
    if sp.min_p != 0.0:
        filters.append(lambda x: min_p_filter(x, sp.min_p))
    if top_k > 0:
        filters.append(lambda x: top_k_filter(x, top_k))
    return filters


def sampling_logprobs(sp: SamplingParams, logprobs: mx.array) -> mx.array:
    """The normalized log-probabilities `keyed_sampler` draws from, row by row: its
    filters, then the temperature (speculative sampling's target, justfit.engine.speculate)."""
    if sp.temperature == 0:
        raise ValueError("greedy decoding draws from no distribution: use justfit.engine.speculate.greedy_accept")
    for f in sampling_filters(sp, int(logprobs.shape[-1])):
        logprobs = f(logprobs)
    scaled = logprobs.astype(mx.float32) * (1.0 / sp.temperature)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


# mlx-lm's filters do the same, but compiled with MLX's global RNG state as an input and
# output: each call replaces that state with an array whose graph holds the call's
# logits, a chain across every sampled token that nothing evaluates.
def top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the most likely tokens whose probabilities add up to `top_p` (nucleus)."""
    ordered = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ordered, dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def min_p_filter(logprobs: mx.array, min_p: float) -> mx.array:
    """Keep the tokens at least `min_p` times as likely as the most likely one."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logprobs < floor, -float("inf"), logprobs)


def top_k_filter(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the `top_k` most likely tokens."""
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(-float("inf"), logprobs.dtype), axis=-1)


def logits_processors(sp: SamplingParams, prompt_len: int) -> list:
    """Repetition penalty over the recent context, and OpenAI's frequency and presence
    penalties over the reply's tokens only (as vLLM does): a prompt's repeated words are
    no reason to avoid them in the answer."""
    repetition = make_logits_processors(
        repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1.0 else None,
        repetition_context_size=sp.repetition_context)
    procs = make_logits_processors(presence_penalty=sp.presence_penalty or None, presence_context_size=sp.max_tokens,
                                   frequency_penalty=sp.frequency_penalty or None,
                                   frequency_context_size=sp.max_tokens)
    return repetition + [lambda tokens, logits, p=p: p(tokens[prompt_len:], logits) for p in procs]

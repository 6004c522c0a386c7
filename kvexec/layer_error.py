"""What a page format costs a model: per layer at its attention output, and at the output.

One teacher-forced pass through float32 pages records, per attention layer, every
chunk's queries and the keys and values appended (`record`), and per position the output
distribution's most likely tokens (`Reference`). Replaying a layer's record into a page
store of another format and comparing its attention outputs with the float32 pages'
gives that layer's error alone (`layer_errors`: relative RMS over every query, nothing
propagated from the layers before it): cheap, one layer at a time. `output_kl` runs the
model with pages in a given configuration and measures what reaches the next-token
distribution: one forward pass, used to learn how much a model amplifies attention
errors (kvexec/calibrate.py).

The KL is binned: the reference's `TOP` most likely tokens each, and the rest of the
vocabulary as one bin. That is a lower bound of the full KL and close to it when the
reference puts its mass on few tokens, and keeps a position's reference at TOP + 1
numbers instead of the vocabulary (262,144 for Gemma 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvexec.attention import blockwise_attention
from kvexec.cache import PagedKVCache, make_cache
from kvexec.config import KVConfig
from kvexec.store import PageStore
from phaseswap.predict import output_head, transformer_body

TOP = 64
# Positions whose output distributions are taken at once (float32 copies of vocabulary-wide
# rows); where the model's output is its head applied to its body's, also the positions
# whose logits exist at once: a chunk's whole [positions, vocabulary] logits were the
# calibration's largest transient on a large vocabulary (docs/BENCHMARKS.md, first load).
ROWS = 8
# Positions a recorded or measured pass feeds at once.
CHUNK = 256


@dataclass
class LayerRecord:
    """What one attention layer saw during a recorded pass, chunk by chunk."""

    window: int | None
    queries: list[mx.array] = field(default_factory=list)
    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)
    scale: float = 1.0
    sinks: mx.array | None = None


@dataclass
class Reference:
    """Per position: the reference's TOP most likely tokens and their log-probabilities,
    and the log of the probability left to the rest of the vocabulary."""

    tokens: list[np.ndarray] = field(default_factory=list)  # per chunk, [positions, TOP]
    logprobs: list[np.ndarray] = field(default_factory=list)
    rest: list[np.ndarray] = field(default_factory=list)  # per chunk, [positions]


class _RecordingCache(PagedKVCache):
    """float32 pages that also keep what the layer appended and attended with."""

    def __init__(self, config: KVConfig, window: int | None):
        super().__init__(config, window)
        self.record = LayerRecord(window)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.record.keys.append(keys.astype(mx.float32))
        self.record.values.append(values.astype(mx.float32))
        return super().update_and_fetch(keys, values)

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        self.record.queries.append(queries.astype(mx.float32))
        self.record.scale, self.record.sinks = scale, sinks
        return super().attend(queries, scale, sinks)


def _log_softmax_rows(logits: mx.array, rows: int = ROWS):
    """(first row, log-softmax of `rows` positions' logits) over a chunk's [1, L, vocab]
    logits. numpy's vectorized exp: MLX's CPU exp is scalar, and rows are vocabulary-wide;
    a few rows at a time, as each row is computed alone: the whole chunk's float32 copies
    were several times the logits (GiBs for Gemma 3's 262,144-token vocabulary)."""
    for first in range(0, logits.shape[1], rows):
        x = np.array(logits[0, first:first + rows].astype(mx.float32))
        x -= x.max(axis=-1, keepdims=True)
        yield first, x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _split(model: nn.Module, ids: list[int], layout: KVConfig) -> tuple | None:
    """(body, head) where `model`'s logits are head(body(x)), as mlx-lm's models compute
    them: checked on the first two positions (fresh pages each); None where the model is
    not shaped so or its own call applies more."""
    body, head = transformer_body(model), output_head(model)
    if body is None or head is None:
        return None
    x = mx.array(ids[:2])[None]
    whole = model(x, cache=make_cache(model, layout))
    parts = head(body(x, cache=make_cache(model, layout)))
    same = whole.shape == parts.shape and mx.allclose(whole, parts, rtol=1e-5, atol=1e-5).item()
    return (body, head) if same else None


def _chunk_log_probs(model: nn.Module, split: tuple | None, ids: list[int], caches: list):
    """(first row, log-softmax of rows) of the outputs at `ids`, fed into `caches`: the
    body once and the head ROWS positions at a time where `split` is given, else the
    model's whole logits."""
    if split is None:
        yield from _log_softmax_rows(model(mx.array(ids)[None], cache=caches))
        return
    body, head = split
    hidden = body(mx.array(ids)[None], cache=caches)
    mx.eval(hidden)
    for first in range(0, hidden.shape[1], ROWS):
        yield first, next(_log_softmax_rows(head(hidden[:, first:first + ROWS])))[1]


def _log_rest(top_logprobs: np.ndarray) -> np.ndarray:
    return np.log(np.clip(1.0 - np.exp(top_logprobs).sum(axis=-1), 1e-12, None))


def record(model: nn.Module, ids: list[int], layout: KVConfig, chunk: int = CHUNK) -> tuple[list[LayerRecord], Reference]:
    """Run `ids` through `model` on float32 pages in `layout`, in chunks: each attention
    layer's record, and the output reference."""
    caches = []
    for c in make_cache(model, layout):
        caches.append(_RecordingCache(c.store.config, c.store.window) if isinstance(c, PagedKVCache) else c)
    ref, split = Reference(), _split(model, ids, layout)
    for start in range(0, len(ids), chunk):
        tops, logprobs = [], []
        for _, lp in _chunk_log_probs(model, split, ids[start : start + chunk], caches):
            # a copy: the slice alone would keep the whole [rows, vocabulary] index array alive
            tops.append(np.argpartition(-lp, TOP, axis=-1)[:, :TOP].copy())
            logprobs.append(np.take_along_axis(lp, tops[-1], axis=-1))
        ref.tokens.append(np.concatenate(tops))
        ref.logprobs.append(np.concatenate(logprobs))
        ref.rest.append(_log_rest(ref.logprobs[-1]))
        mx.eval([c.state for c in caches])
    return [c.record for c in caches if isinstance(c, _RecordingCache)], ref


def output_kl(model: nn.Module, ids: list[int], config: KVConfig, ref: Reference, chunk: int = CHUNK) -> float:
    """Mean binned KL(reference || output) per position with pages as `config` keeps them."""
    caches, split = make_cache(model, config), _split(model, ids, config)
    total, n = 0.0, 0
    for i, start in enumerate(range(0, len(ids), chunk)):
        got = np.concatenate([np.take_along_axis(lp, ref.tokens[i][first:first + len(lp)], axis=-1)
                              for first, lp in _chunk_log_probs(model, split, ids[start : start + chunk], caches)])
        mx.eval([c.state for c in caches])
        p = np.exp(ref.logprobs[i])
        total += float((p * (ref.logprobs[i] - got)).sum())
        total += float((np.exp(ref.rest[i]) * (ref.rest[i] - _log_rest(got))).sum())
        n += got.shape[0]
    return max(total / n, 0.0)


def _outputs(rec: LayerRecord, config: KVConfig) -> list[mx.array]:
    store = PageStore(config, rec.window)
    out = []
    for q, k, v in zip(rec.queries, rec.keys, rec.values):
        store.append(k, v)
        out.append(blockwise_attention(q, store.blocks(), store.offset - q.shape[-2], rec.scale, rec.window,
                                       rec.sinks, block_tokens=config.block_tokens))
        mx.eval(out[-1], store.arrays())
    return out


def layer_errors(records: list[LayerRecord], formats: list[list[str]], config: KVConfig) -> list[dict[str, float]]:
    """Per layer, format -> relative RMS error of the layer's attention outputs with pages in
    that format against float32 pages in the same layout, for that layer's formats
    (`formats[i]` for layer i: allocated ones differ per layer)."""
    out = []
    for rec, names in zip(records, formats, strict=True):
        ref = _outputs(rec, replace(config, format="fp32"))
        norm = sum(float((b**2).sum()) for b in ref)
        errors = {}
        for f in names:
            got = _outputs(rec, replace(config, format=f))
            errors[f] = (sum(float(((a - b) ** 2).sum()) for a, b in zip(got, ref)) / max(norm, 1e-30)) ** 0.5
        out.append(errors)
    return out

"""Per-layer attention error of a page format, on a model's own queries, keys and values.

One teacher-forced pass through float32 pages records, per attention layer, every
chunk's queries and the keys and values appended (`record`). Replaying a layer's
record into a page store of another format and comparing its attention outputs with
the float32 pages' gives that layer's error alone (`layer_errors`): relative RMS over
every query, nothing propagated from the layers before it. Calibration picks formats
with it (kvexec/calibrate.py); it is also the quick proxy for a format's fidelity.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from kvexec.attention import blockwise_attention
from kvexec.cache import PagedKVCache, make_cache
from kvexec.config import KVConfig
from kvexec.store import PageStore


@dataclass
class LayerRecord:
    """What one attention layer saw during a recorded pass, chunk by chunk."""

    window: int | None
    queries: list[mx.array] = field(default_factory=list)
    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)
    scale: float = 1.0
    sinks: mx.array | None = None


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


def record(model: nn.Module, ids: list[int], chunk: int = 256) -> list[LayerRecord]:
    """Run `ids` through `model` on float32 pages in chunks; each attention layer's record."""
    caches = []
    for c in make_cache(model, KVConfig(format="fp32")):
        caches.append(_RecordingCache(c.store.config, c.store.window) if isinstance(c, PagedKVCache) else c)
    for start in range(0, len(ids), chunk):
        model(mx.array(ids[start : start + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return [c.record for c in caches if isinstance(c, _RecordingCache)]


def _outputs(rec: LayerRecord, config: KVConfig) -> list[mx.array]:
    store = PageStore(config, rec.window)
    out = []
    for q, k, v in zip(rec.queries, rec.keys, rec.values):
        store.append(k, v)
        out.append(blockwise_attention(q, store.blocks(), store.offset - q.shape[-2], rec.scale, rec.window,
                                       rec.sinks, block_tokens=config.block_tokens))
        mx.eval(out[-1], store.arrays())
    return out


def relative_error(rec: LayerRecord, config: KVConfig, reference: list[mx.array] | None = None) -> float:
    """Relative RMS error of the layer's attention outputs with pages in `config`'s
    format against `reference` (default: float32 pages with the same layout)."""
    ref = reference if reference is not None else _outputs(rec, replace(config, format="fp32"))
    got = _outputs(rec, config)
    err = sum(float(((a - b) ** 2).sum()) for a, b in zip(got, ref))
    norm = sum(float((b**2).sum()) for b in ref)
    return (err / max(norm, 1e-30)) ** 0.5


def layer_errors(records: list[LayerRecord], formats: list[str], config: KVConfig) -> list[dict[str, float]]:
    """Per layer, format -> relative attention-output error (see `relative_error`)."""
    out = []
    for rec in records:
        ref = _outputs(rec, replace(config, format="fp32"))
        out.append({f: relative_error(rec, replace(config, format=f), ref) for f in formats})
    return out

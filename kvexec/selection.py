"""Page selection (Quest): a decode query attends only to the `KVConfig.select_pages`
pages whose keys could score highest, by per-channel key bounds kept per segment."""

from __future__ import annotations

import mlx.core as mx

from kvexec.segments import Segment


def select_pages(segments: list[Segment], queries: mx.array | None, k: int | None) -> list[Segment]:
    """The `k` segments (one page each) whose key bounds could score highest against a
    single decode query, in position order; all of them otherwise."""
    if not k or queries is None or queries.shape[-2] != 1 or len(segments) <= k:
        return segments
    B, H, _, D = queries.shape
    kvh = segments[0].key_min.shape[1]
    q = queries.astype(mx.float32).reshape(B, kvh, H // kvh, D)[:, None]  # [B, 1, kvh, rep, D]
    lo = mx.stack([s.key_min for s in segments], axis=1)[:, :, :, None]  # [B, n, kvh, 1, D]
    hi = mx.stack([s.key_max for s in segments], axis=1)[:, :, :, None]
    bound = mx.maximum(q * lo, q * hi).sum(axis=-1).max(axis=(0, 2, 3))  # [n]
    top = sorted(mx.argsort(-bound)[:k].tolist())
    return [segments[i] for i in top]

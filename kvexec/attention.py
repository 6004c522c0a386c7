"""Attention executed block by block over a page store, with an online softmax.

Never materializes the whole KV in full precision nor a score matrix over the whole
context: each block's keys and values are decoded, scored, folded into a running
(max, sum, accumulator) and dropped. Grouped-query heads share their KV head's block.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Block:
    keys: mx.array  # [B, kv_heads, n, D] fp32
    values: mx.array
    start: int  # position of the first key


def _visibility(q_start: int, L: int, k_start: int, n: int, window: int | None):
    """None (all visible), False (nothing visible) or a [L, n] bool mask."""
    q_end, k_end = q_start + L - 1, k_start + n - 1
    if k_start > q_end:
        return False
    if window is not None and q_start - k_end >= window:
        return False
    causal_full = k_end <= q_start
    window_full = window is None or q_end - k_start < window
    if causal_full and window_full:
        return None
    qpos = mx.arange(q_start, q_start + L)[:, None]
    kpos = mx.arange(k_start, k_start + n)[None]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (qpos - kpos < window)
    return mask


def blockwise_attention(
    queries: mx.array,
    blocks,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """softmax(q k^T * scale + causal/window mask) v over `blocks`, for queries at
    positions q_start .. q_start + L - 1. queries: [B, H, L, D]."""
    B, H, L, D = queries.shape
    dtype = queries.dtype
    q = None
    m = l = acc = None
    for block in blocks:
        n = block.keys.shape[-2]
        visible = _visibility(q_start, L, block.start, n, window)
        if visible is False:
            continue
        kv_heads = block.keys.shape[1]
        rep = H // kv_heads
        if q is None:
            q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, rep * L, D)
            m = mx.full((B, kv_heads, rep * L, 1), -mx.inf, dtype=mx.float32)
            l = mx.zeros((B, kv_heads, rep * L, 1), dtype=mx.float32)
            acc = mx.zeros((B, kv_heads, rep * L, D), dtype=mx.float32)
        s = q @ block.keys.swapaxes(-1, -2)  # [B, kvh, rep*L, n]
        if visible is not None:
            s = mx.where(visible, s.reshape(B, kv_heads, rep, L, n), -mx.inf).reshape(s.shape)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with nothing visible yet
        p = mx.exp(s - m_safe)
        corr = mx.exp(m - m_safe)
        l = l * corr + p.sum(axis=-1, keepdims=True)
        acc = acc * corr + p @ block.values
        m = m_new
    if q is None:
        raise ValueError("no key is visible to these queries")
    if sinks is not None:  # a per-head logit that takes probability mass, no value
        kv_heads = acc.shape[1]
        sink = sinks.astype(mx.float32).reshape(1, kv_heads, H // kv_heads, 1, 1)
        sink = mx.broadcast_to(sink, (B, kv_heads, H // kv_heads, L, 1)).reshape(m.shape)
        m_new = mx.maximum(m, sink)
        corr = mx.exp(m - m_new)
        l = l * corr + mx.exp(sink - m_new)
        acc = acc * corr
    out = acc / l
    return out.reshape(B, H, L, D).astype(dtype)

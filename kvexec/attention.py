"""Attention executed block by block over a page store, with an online softmax.

Never materializes the whole KV in full precision nor a score matrix over the whole
context: each block's scores are computed, folded into a running (max, sum,
accumulator) and dropped. Few query rows (decode) are scored straight on the stored
form (`quantized_matmul` for quantized pages); many rows (prefill chunks) decode the
block once and use dense GEMMs. Grouped-query heads share their KV head's block.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kvexec.formats import KVFormat, get_format

# Query rows (heads per KV head x queries) up to which blocks are scored in place.
DIRECT_ROWS = 32
# Score matrices at least this large are folded (evaluated) one block at a time.
EVAL_EVERY_BLOCK = 1 << 20


@dataclass
class Block:
    keys: dict[str, mx.array]  # stored form: [B, kv_heads, ...]
    values: dict[str, mx.array]
    fmt: KVFormat
    start: int  # position of the first key
    length: int
    tag: object = None  # what the block came from (the store's segment)

    @property
    def kv_heads(self) -> int:
        return next(iter(self.keys.values())).shape[1]


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


def _merged(blocks, rows: int, limit: int):
    """For many query rows (prefill), fold adjacent small blocks into decoded blocks of
    up to `limit` keys: fewer, larger GEMMs, and the same per-call transient whatever
    the context (the largest block is `limit` once the context is that long)."""
    pending: list[Block] = []

    def flush():
        if len(pending) == 1:
            return pending[0]
        keys = mx.concatenate([b.fmt.keys.decode(b.keys) for b in pending], axis=-2)
        values = mx.concatenate([b.fmt.values.decode(b.values) for b in pending], axis=-2)
        return Block({"x": keys}, {"x": values}, get_format("fp32"), pending[0].start, keys.shape[-2])

    for block in blocks:
        if rows // block.kv_heads <= DIRECT_ROWS:
            yield block
            continue
        fits = pending and pending[-1].start + pending[-1].length == block.start and \
            sum(b.length for b in pending) + block.length <= limit
        if pending and not fits:
            yield flush()
            pending = []
        pending.append(block)
    if pending:
        yield flush()


def _softmax_step(s: mx.array, m: mx.array):
    """Unnormalized block probabilities against the running max. (mx.compile with
    shapeless=True crashed MLX 0.32's CPU backend here; per-shape compiles would
    recompile on every decode step, as the hot window grows.)"""
    m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
    m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with nothing visible yet
    return mx.exp(s - m_safe), mx.exp(m - m_safe), m_new, m_safe


def _fold(l: mx.array, acc: mx.array, corr: mx.array, p: mx.array, pv: mx.array):
    return l * corr + p.sum(axis=-1, keepdims=True), acc * corr + pv


def blockwise_attention(
    queries: mx.array,
    blocks,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    observe=None,
    block_tokens: int = 2048,
) -> mx.array:
    """softmax(q k^T * scale + causal/window mask) v over `blocks`, for queries at
    positions q_start .. q_start + L - 1. queries: [B, H, L, D]. `observe(block, mass)`,
    if given, receives the attention probability each block got, summed over rows."""
    B, H, L, D = queries.shape
    q = m = l = acc = None
    seen = []  # (block, row sums of p, running max then) for `observe`
    if observe is None:
        blocks = _merged(blocks, H * L, block_tokens)
    for block in blocks:
        n = block.length
        visible = _visibility(q_start, L, block.start, n, window)
        if visible is False:
            continue
        kvh = block.kv_heads
        rep = H // kvh
        if q is None:
            q = (queries.astype(mx.float32) * scale).reshape(B, kvh, rep * L, D)
            m = mx.full((B, kvh, rep * L, 1), -mx.inf, dtype=mx.float32)
            l = mx.zeros((B, kvh, rep * L, 1), dtype=mx.float32)
            acc = mx.zeros((B, kvh, rep * L, D), dtype=mx.float32)
        direct = rep * L <= DIRECT_ROWS
        s = block.fmt.keys.scores(q, block.keys) if direct else q @ block.fmt.keys.decode(block.keys).swapaxes(-1, -2)
        if visible is not None:
            s = mx.where(visible, s.reshape(B, kvh, rep, L, n), -mx.inf).reshape(s.shape)
        p, corr, m_new, m_safe = _softmax_step(s, m)
        pv = block.fmt.values.weighted(p, block.values) if direct else p @ block.fmt.values.decode(block.values)
        l, acc = _fold(l, acc, corr, p, pv)
        m = m_new
        if observe is not None:
            seen.append((block, p.sum(axis=-1, keepdims=True), m_safe))
        if s.size >= EVAL_EVERY_BLOCK:
            # MLX would otherwise schedule every block's scores before folding any:
            # evaluating here is what keeps the transient at one block.
            mx.eval(m, l, acc)
    if q is None:
        raise ValueError("no key is visible to these queries")
    if sinks is not None:  # a per-head logit that takes probability mass, no value
        kvh = acc.shape[1]
        sink = sinks.astype(mx.float32).reshape(1, kvh, H // kvh, 1, 1)
        sink = mx.broadcast_to(sink, (B, kvh, H // kvh, L, 1)).reshape(m.shape)
        m_new = mx.maximum(m, sink)
        corr = mx.exp(m - m_new)
        l = l * corr + mx.exp(sink - m_new)
        acc = acc * corr
    if observe is not None:
        m_final = mx.where(m == -mx.inf, 0.0, m)
        for block, rows, m_then in seen:
            observe(block, float((rows * mx.exp(m_then - m_final) / l).sum().item()))
    return (acc / l).reshape(B, H, L, D).astype(queries.dtype)

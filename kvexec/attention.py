"""Attention executed block by block over a page store, with an online softmax.

Never materializes the whole KV in full precision nor a score matrix over the whole
context: each block's scores are computed, folded into a running (max, sum,
accumulator) and dropped. Few query rows (decode) are scored straight on the stored
form (`quantized_matmul` for quantized pages); many rows (prefill chunks) decode the
block once and use dense GEMMs. Grouped-query heads share their KV head's block.

The online softmax's steps are in kvexec/online.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from kvexec.formats import KVFormat, get_format
from kvexec.rotated import unrotate
from kvexec.kernels import rows_kernel
from kvexec.fused import available as fused_available, fused_attention
from kvexec.online import fold_block, softmax, softmax_step, softmax_step_numpy

# Query rows (heads per KV head x queries) up to which blocks are scored in place.
DIRECT_ROWS = 32
# Query positions up to which attention always computes each row as a lone query at its
# position would (`invariant_rows`): a decode step's, a batched step's or a verified
# draft's rows then give the logits single steps give, at no cost (few rows).
INVARIANT_POSITIONS = 32
# Score matrices at least this large are folded (evaluated) one block at a time.
EVAL_EVERY_BLOCK = 1 << 20
# Few query rows over at most this many scores in all: one softmax over every block's
# scores instead of the online fold (decode: ~4 MLX ops per block instead of ~15; on
# CPU the per-op overhead, not arithmetic, is what decode attention spends).
TWO_PASS_SCORES = 1 << 22


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


@dataclass
class Block:
    """A run of stored keys and values in one format, which the executor scores as a unit."""

    stored_keys: dict[str, mx.array]  # stored form: [B, kv_heads, ...], holding at least `length`
    stored_values: dict[str, mx.array]  # tokens from the first (a segment's storage holds more)
    fmt: KVFormat
    start: int  # position of the first key (after the lead)
    length: int  # keys, the lead's included
    tag: object = None  # what the block came from (the store's segment)
    # Keys first in the block whose positions are 0 .. lead - 1, the rest from `start` on
    # (the sinks copied in front of the hot window: kvexec/hot.py); layers without a window.
    lead: int = 0

    @property
    def end(self) -> int:
        """One past the position of the last key."""
        return self.start + self.length - self.lead

    # The block's own tokens, made when first read: native decode attention reads the
    # storage itself, and slicing every segment at every step costs Python time there.
    @functools.cached_property
    def keys(self) -> dict[str, mx.array]:
        """The stored form of the block's keys, exactly `length` tokens."""
        return self.fmt.keys.view(self.stored_keys, 0, self.length)

    @functools.cached_property
    def values(self) -> dict[str, mx.array]:
        """The stored form of the block's values, exactly `length` tokens."""
        return self.fmt.values.view(self.stored_values, 0, self.length)

    @property
    def kv_heads(self) -> int:
        """KV heads the block's keys hold."""
        return next(iter(self.stored_keys.values())).shape[1]


def _sees(q_start: int, L: int, k_start: int, n: int, window: int | None) -> bool:
    """Whether any of the L queries from q_start sees any of the n keys from k_start."""
    return k_start <= q_start + L - 1 and (window is None or q_start - (k_start + n - 1) < window)


def _visibility(q_start: int, L: int, k_start: int, n: int, window: int | None):
    """None (all visible), False (nothing visible) or a [L, n] bool mask."""
    if not _sees(q_start, L, k_start, n, window):
        return False
    q_end, k_end = q_start + L - 1, k_start + n - 1
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


def _block_sees(q_start: int, L: int, block: Block, window: int | None) -> bool:
    """`_sees` for a block (one with a lead: positions 0 on, seen by any query)."""
    return True if block.lead else _sees(q_start, L, block.start, block.length, window)


def _block_visibility(q_start: int, L: int, block: Block, window: int | None):
    """`_visibility` for a block: a lead (positions 0 .. lead - 1) is seen causally too."""
    if not block.lead:
        return _visibility(q_start, L, block.start, block.length, window)
    parts = [_visibility(q_start, L, 0, block.lead, None), _visibility(q_start, L, block.start, block.length - block.lead, None)]
    if parts[0] is None and parts[1] is None:
        return None
    return mx.concatenate([mx.full((L, n), p is None) if isinstance(p, bool) or p is None else p
                           for p, n in zip(parts, (block.lead, block.length - block.lead))], axis=1)


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
        if rows // block.kv_heads <= DIRECT_ROWS or block.lead:
            if pending:  # (a block with a lead keeps its own positions: not joined)
                yield flush()
                pending = []
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


def _masked(s: mx.array, visible, rep: int, L: int) -> mx.array:
    """Scores [B, kvh, rep * L, n] with invisible keys at -inf (`visible`: [L, n] or None)."""
    if visible is None:
        return s
    B, kvh, _, n = s.shape
    return mx.where(visible, s.reshape(B, kvh, rep, L, n), -mx.inf).reshape(s.shape)


def _sink_logits(sinks: mx.array, B: int, kvh: int, rep: int, L: int) -> mx.array:
    """The per-head sink logit as one score column, [B, kvh, rep * L, 1]."""
    sink = sinks.astype(mx.float32).reshape(1, kvh, rep, 1, 1)
    return mx.broadcast_to(sink, (B, kvh, rep, L, 1)).reshape(B, kvh, rep * L, 1)


def _block_scores(q: mx.array, block: Block, visible, rep: int, L: int, direct: bool) -> mx.array:
    """The block's masked scores, [B, kvh, rep * L, n]: a new array only the caller
    holds (`softmax_step_numpy` may overwrite it)."""
    s = block.fmt.keys.scores(q, block.keys) if direct else q @ block.fmt.keys.decode(block.keys).swapaxes(-1, -2)
    return _masked(s, visible, rep, L)


def blockwise_attention(
    queries: mx.array,
    blocks,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    observe=None,
    block_tokens: int = 2048,
    tokens_major: bool = False,
    row_invariant: bool = False,
) -> mx.array:
    """softmax(q k^T * scale + causal/window mask) v over `blocks`, for queries at
    positions q_start .. q_start + L - 1. queries: [B, H, L, D]; the result is shaped
    like them, or with `tokens_major` [B, L, H * D] (as a layer's output projection takes
    it). `observe(block, mass)`, if given, receives the attention probability each
    block got, summed over rows. With `row_invariant` (and always for at most
    INVARIANT_POSITIONS queries), each query row is computed as a decode step at its
    position computes it, whatever rows share the call (`invariant_rows`; where the
    native kernel cannot take the blocks, as without)."""
    B, H, L, D = queries.shape
    blocks = list(blocks)
    kvh = blocks[0].kv_heads if blocks else 1
    if (row_invariant or L <= INVARIANT_POSITIONS) and sinks is None and observe is None:
        out = invariant_rows(queries, blocks, q_start, scale, window, tokens_major)
        if out is not None:
            return out
    if (H // kvh) * L <= DIRECT_ROWS and B * H * L * sum(b.length for b in blocks) <= TWO_PASS_SCORES:
        # (the native operation, where it takes the blocks, already ran above as `invariant_rows`)
        out = _two_pass(queries, blocks, q_start, scale, window, sinks, observe)
    else:
        out = _online(queries, blocks, q_start, scale, window, sinks, observe, block_tokens)
    return out.swapaxes(1, 2).reshape(B, L, H * D) if tokens_major else out


def invariant_rows(queries: mx.array, blocks: list, q_start: int, scale: float, window: int | None,
                   tokens_major: bool = False) -> mx.array | None:
    """Attention whose every query row is computed as a lone query at its position
    computes it (native/decode_attention.cpp: each row's softmax spans only the keys it
    sees, in their order; the scores and value products are per row): the queries in
    groups whose scores take at most TWO_PASS_SCORES, one native operation each. None
    where the kernel is not built or cannot take these blocks, or where one position's
    scores alone take more (the transient stays bounded: past about TWO_PASS_SCORES /
    heads positions, rows are not computed as lone queries)."""
    if not fused_available():
        return None
    B, H, L, D = queries.shape
    total = sum(b.length for b in blocks)
    if B * H * total > TWO_PASS_SCORES:
        return None
    per = TWO_PASS_SCORES // (B * H * total)
    outs = []
    for g0 in range(0, L, per):
        n = min(per, L - g0)
        seen = [b for b in blocks if _sees(q_start + g0, n, b.start, b.length, window)]
        out = fused_attention(queries[:, :, g0:g0 + n], seen, q_start + g0, scale, window, tokens_major)
        if out is None:
            return None
        outs.append(out)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1 if tokens_major else 2)


def _online(queries, blocks, q_start, scale, window, sinks, observe, block_tokens) -> mx.array:
    """Many query rows: blocks folded into a running (max, sum, accumulator) one by one."""
    B, H, L, D = queries.shape
    q = m = l = acc = None
    seen = []  # (block, row sums of p, running max then) for `observe`
    if observe is None:
        blocks = _merged(blocks, H * L, block_tokens)
    native = rows_kernel() if observe is None else None
    native = native if native is not None and hasattr(native, "softmax_step") else None
    fold = getattr(native, "attention_fold", None) if D % 16 == 0 else None
    for block in blocks:
        n = block.length
        if not _block_sees(q_start, L, block, window):
            continue
        kvh = block.kv_heads
        rep = H // kvh
        if q is None:
            q = (queries.astype(mx.float32) * scale).reshape(B, kvh, rep * L, D)
            m = mx.full((B, kvh, rep * L, 1), -mx.inf, dtype=mx.float32)
            l = mx.zeros((B, kvh, rep * L, 1), dtype=mx.float32)
            acc = mx.zeros((B, kvh, rep * L, D), dtype=mx.float32)
        direct = rep * L <= DIRECT_ROWS
        big = B * H * L * n >= EVAL_EVERY_BLOCK  # the scores' size
        if fold is not None and not direct:  # scores, softmax and p V in cache-sized tiles: one operation
            m_new, l, acc = fold(q, block.fmt.keys.decode(block.keys), block.fmt.values.decode(block.values), m, l,
                                 acc, L, q_start, block.start, window or 0)
        elif native is not None:  # mask, max, exponentials and row sums as one operation on both cores
            p, corr, m_new, rows = native.softmax_step(_block_scores(q, block, None, rep, L, direct), m, L, q_start,
                                                       block.start, window or 0)
            pv = block.fmt.values.weighted(p, block.values) if direct else p @ block.fmt.values.decode(block.values)
            l, acc = l * corr + rows, acc * corr + pv
        else:
            visible = _block_visibility(q_start, L, block, window)
            step = softmax_step_numpy if big and _on_cpu() else softmax_step
            # The scores go straight into the step: no name here outlives the numpy overwrite.
            p, corr, m_new, m_safe = step(_block_scores(q, block, visible, rep, L, direct), m)
            pv = block.fmt.values.weighted(p, block.values) if direct else p @ block.fmt.values.decode(block.values)
            l, acc = fold_block(l, acc, corr, p, pv)
        m = m_new
        if observe is not None:
            seen.append((block, p.sum(axis=-1, keepdims=True), m_safe))
        if big:
            # MLX would otherwise schedule every block's scores before folding any:
            # evaluating here is what keeps the transient at one block.
            mx.eval(m, l, acc)
    if q is None:
        raise ValueError("no key is visible to these queries")
    if sinks is not None:  # a per-head logit that takes probability mass, no value
        kvh = acc.shape[1]
        sink = _sink_logits(sinks, B, kvh, H // kvh, L)
        m_new = mx.maximum(m, sink)
        corr = mx.exp(m - m_new)
        l = l * corr + mx.exp(sink - m_new)
        acc = acc * corr
    if observe is not None:
        m_final = mx.where(m == -mx.inf, 0.0, m)
        for block, rows, m_then in seen:
            observe(block, float((rows * mx.exp(m_then - m_final) / l).sum().item()))
    return (acc / l).reshape(B, H, L, D).astype(queries.dtype)


def _two_pass(queries, blocks, q_start, scale, window, sinks, observe) -> mx.array:
    """Few query rows: score every block on its stored form, one softmax over all the
    scores (the transient is rows x context, kept small by TWO_PASS_SCORES), then sum
    each block's probability-weighted values. At decode this runs per layer and step,
    so it makes as few MLX operations as it can: no mask where every key is visible,
    one softmax over a lone block's scores as they are, one split of the probabilities."""
    B, H, L, D = queries.shape
    kvh = blocks[0].kv_heads
    rep = H // kvh
    q = (queries.astype(mx.float32) * scale).reshape(B, kvh, rep * L, D)
    used, scores, ends, end = [], [], [], 0
    for block in blocks:
        if window is None and block.end <= q_start + 1:
            visible = None  # every key at or before the first query: all seen by all
        else:
            visible = _block_visibility(q_start, L, block, window)
            if visible is False:
                continue
        s = block.fmt.keys.scores(q, block.keys)
        used.append(block)
        scores.append(s if visible is None else _masked(s, visible, rep, L))
        end += block.length
        ends.append(end)
    if not used:
        raise ValueError("no key is visible to these queries")
    if sinks is not None:  # a per-head logit that takes probability mass, no value
        scores.append(_sink_logits(sinks, B, kvh, rep, L))
    else:
        ends.pop()  # the last block's probabilities run to the end
    p = softmax(scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1))
    parts = mx.split(p, ends, axis=-1) if ends else [p]  # one operation, not a slice per block
    sums = {}  # rotated values or not -> sum of p V over those blocks
    for block, pb in zip(used, parts):
        rotated = block.fmt.values.rotated  # the same rotation for every such codec
        pv = block.fmt.values.weighted(pb, block.values, rotate=False)
        sums[rotated] = pv + sums[rotated] if rotated in sums else pv
        if observe is not None:
            observe(block, float(pb.sum().item()))
    out = sums.get(False)
    if True in sums:  # one rotation back for every rotated block (a linear map)
        out = unrotate(sums[True]) if out is None else out + unrotate(sums[True])
    return out.reshape(B, H, L, D).astype(queries.dtype)


def transient_bytes(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, block_tokens: int,
                    observed: bool = False, row_invariant: bool = False) -> int:
    """The most `blockwise_attention` holds beyond its queries and result for `rows` query
    positions over `context` keys in blocks of up to `block_tokens`, per path: few rows
    over few scores, every block's scores, their concatenation and softmax at once
    (the two-pass path); otherwise one block at a time, decoded to float32 (pieces and
    their concatenation) beside the running state, with either the native fold's keys
    transposed (CPU with the native kernel, head_dim a multiple of 16, no attention mass
    `observed`: scores stay in tiles of a few KiB) or the block's scores and exponentials.
    Rows computed as lone queries (`invariant_rows`: up to INVARIANT_POSITIONS, or any
    number with `row_invariant`) hold one group's scores, at most TWO_PASS_SCORES."""
    invariant = 0
    if ((rows <= INVARIANT_POSITIONS or row_invariant) and not observed and rows_kernel() is not None
            and 0 < heads * context <= TWO_PASS_SCORES):
        group = min(rows, TWO_PASS_SCORES // (heads * context))
        invariant = heads * group * context * 4 + 2 * heads * rows * head_dim * 4  # a group's scores; queries, result
    return max(invariant, _blockwise_transient(rows, context, heads, kv_heads, head_dim, block_tokens, observed))


def _blockwise_transient(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, block_tokens: int,
                         observed: bool) -> int:
    """`transient_bytes` of the paths other than `invariant_rows` (where the kernel
    cannot take the blocks, those run)."""
    rep = heads // kv_heads
    if rep * rows <= DIRECT_ROWS and heads * rows * context <= TWO_PASS_SCORES:
        return 3 * heads * rows * context * 4
    keys = min(context, block_tokens)
    decoded = 2 * 2 * keys * kv_heads * head_dim * 4
    state = 2 * heads * rows * (head_dim + 2) * 4  # accumulator, max and sum: before and after a block
    native = rows_kernel()
    folds = not observed and head_dim % 16 == 0 and native is not None and hasattr(native, "attention_fold")
    if folds and rep * rows > DIRECT_ROWS:
        return decoded + state + keys * kv_heads * head_dim * 4
    return decoded + state + 2 * heads * rows * keys * 4

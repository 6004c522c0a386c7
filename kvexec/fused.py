"""Decode attention over a layer's blocks as one native operation (native/decode_attention.cpp).

The two-pass path in kvexec/attention.py makes 20-30 MLX operations a layer at decode
(a product per block and side, the scores' concatenation, their slices, the sums); on
the CPU each costs MLX's dispatch, more than their arithmetic at short
contexts. The native operation does the same arithmetic in one: every block scored on
its stored form, one softmax, every block's values weighted and summed.

It takes full-precision blocks (sinks, the hot window; float32 or float16) and quantized
pages whose keys are stored per channel (`Codec` with per_channel, `AllocatedCodec`) and
values per token, rotated or not; anything else (rotated codebooks, sinks logits,
attention-mass observers) keeps the two-pass path (`fused_attention` returns None).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kvexec.formats import KVFormat
from kvexec.kernels import rows_kernel

_FULL, _QUANTIZED = 0, 1


def _kernel():
    ext = rows_kernel()
    return ext if ext is not None and hasattr(ext, "decode_attention") else None


def available() -> bool:
    """Whether the native decode attention runs here (built, on, computing on the CPU)."""
    return _kernel() is not None


@functools.lru_cache(maxsize=1024)
def _layout(fmt: KVFormat, widths: tuple[int, ...]):
    """What the kernel needs of a quantized format, looked up once per format: (the spec's
    ints after start and length, per key part its storage names and columns, whether
    anything is rotated); None where the kernel cannot take it."""
    keys, values = fmt.keys, fmt.values
    layout = getattr(keys, "native_layout", None)
    if layout is None or not values.quantized or values.per_channel or not hasattr(values, "group_size"):
        return None
    if values.bits not in widths or any(bits not in widths for *_, bits, _ in layout):
        return None
    columns = layout[0][-1] is not None
    ints = [keys.group_size, int(keys.rotated), values.bits, values.group_size, int(values.rotated), int(columns),
            len(layout)] + [bits for *_, bits, _ in layout]
    parts = [((w, s, b), [idx] if columns else []) for w, s, b, _, idx in layout]
    return ints, parts, keys.rotated or values.rotated


def _spec(block, widths: tuple[int, ...]):
    """(ints, arrays, rotated) describing `block` to the kernel, or None where it cannot take it."""
    if not block.fmt.quantized:
        k, v = block.stored_keys.get("x"), block.stored_values.get("x")
        if k is None or v is None or k.dtype not in (mx.float32, mx.float16) or v.dtype != k.dtype:
            return None
        return [_FULL, block.start, block.length], [k, v], False
    layout = _layout(block.fmt, widths)
    if layout is None:
        return None
    ints, parts, rotated = layout
    # the storage itself (the kernel reads its first `length` tokens: no slice operations)
    stored_k, stored_v = block.stored_keys, block.stored_values
    arrays = []
    for (w, s, b), columns in parts:
        arrays += [stored_k[w], stored_k[s], stored_k[b], *columns]
    arrays += [stored_v["w"], stored_v["scales"], stored_v["biases"]]
    return [_QUANTIZED, block.start, block.length, *ints], arrays, rotated


def fused_attention(queries: mx.array, blocks: list, q_start: int, scale: float,
                    window: int | None, tokens_major: bool = False) -> mx.array | None:
    """softmax(q K^T * scale + mask) V over `blocks` (those with visible keys, in order)
    as one native operation, [B, H, L, D] (or with `tokens_major` [B, L, H * D]), or None
    where the kernel is not built here or cannot take these queries or blocks (the
    caller computes it in MLX operations)."""
    ext = _kernel()
    if ext is None or queries.dtype != mx.float32 or not blocks:
        return None
    widths = tuple(getattr(ext, "ROWS_BITS", ()))
    specs, arrays, rotated = [], [], False
    for block in blocks:
        described = _spec(block, widths)
        if described is None:
            return None
        ints, parts, turns = described
        specs.append(ints)
        arrays += parts
        rotated |= turns
    rotation = None
    if rotated:
        from kvexec.rotated import rotation_pair

        rotation = rotation_pair(blocks[0].kv_heads, queries.shape[-1])
    return ext.decode_attention(queries, arrays, specs, q_start, scale, window or 0, rotation,
                                tokens_major=tokens_major)

"""Exact translation of GGUF block quantizations into MLX's affine format.

Every type here stores, per 32 weights, integer codes q with value = scale * q + bias,
which is exactly MLX's affine quantization at group size 32. The legacy types keep
fp16 scales (their products stay exact in fp16); K-quants multiply an fp16 super-scale
by a 6-bit sub-scale, so their scales and biases are kept in fp32, where they are exact.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K

GROUP = 32


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes (rows, n) as MLX does: a little-endian bitstream in uint32s."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes.view("<u4")
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view("<u4")
    rows = codes.shape[0]
    stream = np.unpackbits(codes[..., None], axis=-1, bitorder="little")[..., :bits]
    return np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little").view("<u4")


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy layout: the 16 low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit i of a little-endian uint32 is the 5th bit of element i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _legacy(blocks: np.ndarray, qtype: QT):
    if qtype == QT.Q8_0:
        d = _f16(blocks[..., :2])
        # code q + 128 of a signed byte is its bits with the top one flipped: one byte
        # per weight, no wider copies of a large vocabulary's embedding
        q = blocks[..., 2:] ^ np.uint8(0x80)
        return q, d, d * np.float16(-128), 8
    if qtype == QT.Q4_0:
        d = _f16(blocks[..., :2])
        return _nibbles(blocks[..., 2:]), d, d * np.float16(-8), 4
    if qtype == QT.Q4_1:
        return _nibbles(blocks[..., 4:]), _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 4
    if qtype == QT.Q5_0:
        d = _f16(blocks[..., :2])
        q = _nibbles(blocks[..., 6:]) | (_high_bits(blocks[..., 2:6]) << 4)
        return q, d, d * np.float16(-16), 5
    if qtype == QT.Q5_1:
        q = _nibbles(blocks[..., 8:]) | (_high_bits(blocks[..., 4:8]) << 4)
        return q, _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 5
    raise KeyError(qtype)


def _k_quant(blocks: np.ndarray, qtype: QT):
    """Q4_K / Q5_K: 256-weight super-blocks of eight 32-weight affine sub-blocks."""
    shape = blocks.shape[:-1]
    flat = blocks.reshape(-1, blocks.shape[-1])
    n = flat.shape[0]
    d = flat[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(flat[:, 4:16].copy())
    qs = flat[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32)
    bits = 4
    if qtype == QT.Q5_K:
        qh = flat[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)
        bits = 5
    scales = d * sc.astype(np.float32)
    biases = -(dmin * m.astype(np.float32))
    return q.reshape(*shape, 8 * 32), scales.reshape(*shape, 8), biases.reshape(*shape, 8), bits


_BLOCK_BYTES = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q5_1: 24,
                QT.Q4_K: 144, QT.Q5_K: 176}
EXACT_TYPES = frozenset(_BLOCK_BYTES)


def to_mlx_affine(data: np.ndarray, qtype: QT) -> tuple[dict[str, np.ndarray], int]:
    """Raw GGUF rows (rows, bytes) -> ({weight, scales, biases}, bits), bit-exact."""
    rows = data.shape[0]
    blocks = np.asarray(data).reshape(rows, -1, _BLOCK_BYTES[qtype])
    convert = _k_quant if qtype in (QT.Q4_K, QT.Q5_K) else _legacy
    q, scales, biases, bits = convert(blocks, qtype)
    return {
        "weight": pack(q.reshape(rows, -1), bits),
        "scales": np.ascontiguousarray(scales.reshape(rows, -1)),
        "biases": np.ascontiguousarray(biases.reshape(rows, -1)),
    }, bits

"""Rotated codebook quantization of K and V (the TurboQuant-MSE idea).

Each KV head has a fixed random rotation: random signs, then a normalized
Walsh-Hadamard transform. A rotated vector divided by its norm has coordinates that
are close to N(0, 1/d) whatever the input's outliers, so one Lloyd-Max codebook for
the standard normal fits every coordinate. A token stores its fp16 norm and a b-bit
code per coordinate. Scores are computed in the rotated space (q is rotated, K is
not rotated back); p V is rotated back once per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

SEED = 0x5EED


@lru_cache(maxsize=None)
def lloyd_max_gaussian(bits: int, iters: int = 200) -> tuple[float, ...]:
    """MSE-optimal scalar quantizer levels for N(0, 1) (Lloyd's algorithm on the pdf)."""
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    n = 1 << bits
    levels = [(-3 + 6 * (i + 0.5) / n) for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = []
        for lo, hi in zip(edges, edges[1:]):
            mass = cdf(hi) - cdf(lo)
            levels.append(((pdf(lo) if lo > -math.inf else 0) - (pdf(hi) if hi < math.inf else 0)) / mass)
    return tuple(levels)


@lru_cache(maxsize=None)
def rotation(kv_heads: int, dim: int) -> mx.array:
    """[kv_heads, dim, dim] orthogonal matrices diag(signs) H / sqrt(dim)."""
    if dim & (dim - 1):
        raise ValueError(f"rotated KV formats need a power-of-two head_dim, not {dim}")
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(SEED).choice([-1.0, 1.0], size=(kv_heads, dim, 1))
    return mx.array((signs * h / math.sqrt(dim)).astype(np.float32))


@lru_cache(maxsize=None)
def rotation_pair(kv_heads: int, dim: int) -> mx.array:
    """[2, kv_heads, dim, dim]: `rotation` and its transpose (what turns rotated values
    back), contiguous, made once: the native decode attention takes both."""
    r = np.array(rotation(kv_heads, dim))
    return mx.array(np.ascontiguousarray(np.stack([r, r.transpose(0, 2, 1)])))


def unrotate(x: mx.array) -> mx.array:
    """A product with rotated values, [B, kv_heads, rows, dim], back in the values' own space."""
    return x @ rotation(x.shape[1], x.shape[-1]).swapaxes(-1, -2)


def _pack(codes: mx.array, bits: int) -> mx.array:
    """[..., n, d] codes < 2**bits -> [..., n, d * bits / 32] uint32, as a bitstream."""
    *lead, d = codes.shape
    bit = (codes[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1  # [..., d, bits]
    bit = bit.reshape(*lead, d * bits // 32, 32)
    return (bit << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def _unpack(words: mx.array, bits: int, d: int) -> mx.array:
    *lead, _ = words.shape
    bit = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    bit = bit.reshape(*lead, d, bits)
    return (bit << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1)


@dataclass(frozen=True)
class RotatedCodec:
    """Keys or values as a codebook index per rotated coordinate and an fp16 norm per token."""

    bits: int
    tokens_last = False  # stored [.., tokens, ..] like per-token affine codes
    rotated = True  # products in the rotated space until rotated back

    @property
    def quantized(self) -> bool:
        """Always true: a rotated codec stores codes."""
        return True

    def _levels(self) -> mx.array:
        return mx.array(lloyd_max_gaussian(self.bits), dtype=mx.float32)

    def encode(self, x: mx.array) -> dict[str, mx.array]:
        """`x` in stored form: packed codes of its rotated, normalized coordinates, and its norms."""
        kvh, d = x.shape[1], x.shape[-1]
        xr = x.astype(mx.float32) @ rotation(kvh, d)
        norm = mx.sqrt((xr * xr).sum(axis=-1, keepdims=True))
        u = xr * (math.sqrt(d) / mx.maximum(norm, 1e-12))
        levels = self._levels()
        edges = (levels[1:] + levels[:-1]) / 2
        codes = (u[..., None] > edges).sum(axis=-1).astype(mx.uint32)
        return {"codes": _pack(codes, self.bits), "norms": norm.astype(mx.float16)}

    def _rotated(self, enc: dict[str, mx.array]) -> mx.array:
        """The stored vectors in the rotated space, fp32."""
        d = enc["codes"].shape[-1] * 32 // self.bits
        u = self._levels()[_unpack(enc["codes"], self.bits, d)]
        return u * (enc["norms"].astype(mx.float32) / math.sqrt(d))

    def decode(self, enc: dict[str, mx.array]) -> mx.array:
        """The stored vectors back in the original space, fp32."""
        xr = self._rotated(enc)
        return xr @ rotation(xr.shape[1], xr.shape[-1]).swapaxes(-1, -2)

    def allocate(self, lead: tuple[int, ...], capacity: int, head_dim: int) -> dict[str, mx.array]:
        """Zeroed codes and norms for `capacity` tokens of `head_dim`-wide vectors under `lead`."""
        return {"codes": mx.zeros((*lead, capacity, head_dim * self.bits // 32), dtype=mx.uint32),
                "norms": mx.zeros((*lead, capacity, 1), dtype=mx.float16)}

    def write(self, storage: dict[str, mx.array], enc: dict[str, mx.array], start: int, n: int) -> None:
        """Write n encoded tokens in place at token index `start`."""
        for name, arr in enc.items():
            storage[name][..., start : start + n, :] = arr

    def view(self, storage: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
        """The stored form of tokens [start, end) in `storage`."""
        return {name: a[..., start:end, :] for name, a in storage.items()}

    def scores(self, q: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """q @ K^T in the rotated space: q turns, the keys are not turned back."""
        kr = self._rotated(enc)
        qr = q @ rotation(kr.shape[1], kr.shape[-1])
        return qr @ kr.swapaxes(-1, -2)

    def weighted(self, p: mx.array, enc: dict[str, mx.array], rotate: bool = True) -> mx.array:
        """p @ V computed in the rotated space, then rotated back once (rotate=False: left
        rotated, for a sum over blocks rotated back once, `unrotate`)."""
        vr = self._rotated(enc)
        out = p @ vr
        return out @ rotation(vr.shape[1], vr.shape[-1]).swapaxes(-1, -2) if rotate else out

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Storage bytes of one token's codes and norms over `kv_heads` heads."""
        return kv_heads * (head_dim * self.bits / 8 + 2)  # codes + fp16 norm

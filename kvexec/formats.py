"""How pages store K and V: full precision or affine group quantization.

A codec stores vectors [B, kv_heads, tokens, head_dim]. Affine codecs group values
along head_dim (per token), or, for keys, along tokens (per channel, as KIVI does:
key outliers live in fixed channels). Either way `scores` and `weighted` compute
q K^T and p V straight on the stored form with `quantized_matmul`, and
`bytes_per_token` is the exact storage cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Codec:
    bits: int  # 16 or 32: full precision
    group_size: int = 32
    per_channel: bool = False  # groups run along tokens instead of head_dim

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def tokens_last(self) -> bool:
        """Stored [.., head_dim, tokens]: per-channel groups run along the last axis."""
        return self.per_channel and self.quantized

    def encode(self, x: mx.array) -> dict[str, mx.array]:
        if not self.quantized:
            return {"x": x.astype(mx.float16 if self.bits == 16 else mx.float32)}
        x = x.astype(mx.float32)
        if self.per_channel:
            x = x.swapaxes(-1, -2)
        w, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return {"w": w, "scales": scales.astype(mx.float16), "biases": biases.astype(mx.float16)}

    def decode(self, enc: dict[str, mx.array]) -> mx.array:
        if not self.quantized:
            return enc["x"].astype(mx.float32)
        x = mx.dequantize(enc["w"], enc["scales"].astype(mx.float32), enc["biases"].astype(mx.float32),
                          group_size=self.group_size, bits=self.bits)
        return x.swapaxes(-1, -2) if self.per_channel else x

    # Storage along the token axis: -2 for per-token layouts, -1 (in packed units) per channel.
    def _widths(self, head_dim: int) -> dict[str, tuple[mx.Dtype, int, int]]:
        """name -> (dtype, per-token extent, units per group of tokens)."""
        if not self.quantized:
            return {"x": (mx.float16 if self.bits == 16 else mx.float32, head_dim, 1)}
        if self.per_channel:  # [.., head_dim, tokens * bits / 32] and [.., head_dim, tokens / group]
            g = self.group_size
            return {"w": (mx.uint32, head_dim, g * self.bits // 32), "scales": (mx.float16, head_dim, 1),
                    "biases": (mx.float16, head_dim, 1)}
        groups = head_dim // self.group_size
        return {"w": (mx.uint32, head_dim * self.bits // 32, 1), "scales": (mx.float16, groups, 1),
                "biases": (mx.float16, groups, 1)}

    def allocate(self, lead: tuple[int, ...], capacity: int, head_dim: int) -> dict[str, mx.array]:
        out = {}
        for name, (dtype, extent, units) in self._widths(head_dim).items():
            if self.tokens_last:
                out[name] = mx.zeros((*lead, extent, capacity // self.group_size * units), dtype=dtype)
            else:
                out[name] = mx.zeros((*lead, capacity, extent), dtype=dtype)
        return out

    def _span(self, name: str, start: int, end: int) -> tuple[int, int]:
        if not self.tokens_last:
            return start, end
        units = self.group_size * self.bits // 32 if name == "w" else 1
        return start // self.group_size * units, end // self.group_size * units

    def write(self, storage: dict[str, mx.array], enc: dict[str, mx.array], start: int, n: int) -> None:
        """Write n encoded tokens in place at token index `start` (a group boundary)."""
        for name, arr in enc.items():
            if self.tokens_last:
                a, b = self._span(name, start, start + n)
                storage[name][..., a:b] = arr
            else:
                storage[name][..., start : start + n, :] = arr

    def view(self, storage: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
        if self.tokens_last:
            return {name: a[..., slice(*self._span(name, start, end))] for name, a in storage.items()}
        return {name: a[..., start:end, :] for name, a in storage.items()}

    def scores(self, q: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """q @ K^T on the stored form."""
        if not self.quantized:
            return q @ enc["x"].astype(q.dtype).swapaxes(-1, -2)
        return mx.quantized_matmul(q, enc["w"], enc["scales"], enc["biases"], transpose=not self.per_channel,
                                   group_size=self.group_size, bits=self.bits)

    def weighted(self, p: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """p @ V on the stored form (values are stored per token)."""
        if not self.quantized:
            return p @ enc["x"].astype(p.dtype)
        return mx.quantized_matmul(p, enc["w"], enc["scales"], enc["biases"], transpose=False,
                                   group_size=self.group_size, bits=self.bits)

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        if not self.quantized:
            return kv_heads * head_dim * self.bits / 8
        return kv_heads * head_dim * (self.bits / 8 + 4 / self.group_size)  # fp16 scale + bias


@dataclass(frozen=True)
class KVFormat:
    name: str
    keys: Codec  # or kvexec.rotated.RotatedCodec: the same interface
    values: Codec

    @property
    def quantized(self) -> bool:
        return self.keys.quantized or self.values.quantized

    @property
    def token_multiple(self) -> int:
        """Pages must hold a multiple of this many tokens."""
        return self.keys.group_size if self.keys.tokens_last else 1

    def supports_head_dim(self, head_dim: int) -> bool:
        """Groups along head_dim need it to hold whole groups of 32."""
        return all(not c.quantized or c.tokens_last or head_dim % 32 == 0 for c in (self.keys, self.values))

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """K and V storage of one token in one layer."""
        return self.keys.bytes_per_token(kv_heads, head_dim) + self.values.bytes_per_token(kv_heads, head_dim)


def _affine(name: str, bits: int, per_channel_keys: bool = False) -> KVFormat:
    return KVFormat(name, Codec(bits, per_channel=per_channel_keys), Codec(bits))


def _rotated(name: str, bits: int) -> KVFormat:
    from kvexec.rotated import RotatedCodec

    return KVFormat(name, RotatedCodec(bits), RotatedCodec(bits))


FORMATS = {
    "fp32": KVFormat("fp32", Codec(32), Codec(32)),
    "fp16": KVFormat("fp16", Codec(16), Codec(16)),
    **{f"q{b}": _affine(f"q{b}", b) for b in (8, 4, 3, 2)},
    **{f"q{b}c": _affine(f"q{b}c", b, per_channel_keys=True) for b in (8, 4, 3, 2)},
    **{f"r{b}": _rotated(f"r{b}", b) for b in (4, 3)},
    # Keys carry the outliers and the softmax's sensitivity; values average out.
    "k8v4": KVFormat("k8v4", Codec(8), Codec(4)),
    "k8v3": KVFormat("k8v3", Codec(8), Codec(3)),
    "k8cv4": KVFormat("k8cv4", Codec(8, per_channel=True), Codec(4)),
}


def get_format(name: str | KVFormat) -> KVFormat:
    if isinstance(name, KVFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r} (known: {', '.join(FORMATS)})") from None

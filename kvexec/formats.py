"""How a page stores K or V: full precision or affine group quantization.

A format encodes a block of vectors [kv_heads, tokens, head_dim] into a dict of
arrays and decodes it back to fp32. `bytes_per_token` is the exact storage cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int  # 16 or 32 for full precision
    group_size: int = 32  # affine: values per (scale, bias) pair along head_dim

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def encode(self, x: mx.array) -> dict[str, mx.array]:
        if not self.quantized:
            return {"x": x.astype(mx.float16 if self.bits == 16 else mx.float32)}
        w, scales, biases = mx.quantize(x.astype(mx.float32), group_size=self.group_size, bits=self.bits)
        return {"w": w, "scales": scales.astype(mx.float16), "biases": biases.astype(mx.float16)}

    def decode(self, enc: dict[str, mx.array]) -> mx.array:
        if not self.quantized:
            return enc["x"].astype(mx.float32)
        return mx.dequantize(enc["w"], enc["scales"].astype(mx.float32), enc["biases"].astype(mx.float32),
                             group_size=self.group_size, bits=self.bits)

    def allocate(self, lead: tuple[int, ...], capacity: int, head_dim: int) -> dict[str, mx.array]:
        """Zeroed storage for `capacity` tokens ([*lead, capacity, ...] per array)."""
        if not self.quantized:
            dtype = mx.float16 if self.bits == 16 else mx.float32
            return {"x": mx.zeros((*lead, capacity, head_dim), dtype=dtype)}
        groups = head_dim // self.group_size
        return {"w": mx.zeros((*lead, capacity, head_dim * self.bits // 32), dtype=mx.uint32),
                "scales": mx.zeros((*lead, capacity, groups), dtype=mx.float16),
                "biases": mx.zeros((*lead, capacity, groups), dtype=mx.float16)}

    def scores(self, q: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """q @ K^T straight on the stored form (no full-precision copy of K)."""
        if not self.quantized:
            return q @ enc["x"].astype(q.dtype).swapaxes(-1, -2)
        return mx.quantized_matmul(q, enc["w"], enc["scales"], enc["biases"], transpose=True,
                                   group_size=self.group_size, bits=self.bits)

    def weighted(self, p: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """p @ V straight on the stored form."""
        if not self.quantized:
            return p @ enc["x"].astype(p.dtype)
        return mx.quantized_matmul(p, enc["w"], enc["scales"], enc["biases"], transpose=False,
                                   group_size=self.group_size, bits=self.bits)

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Storage of one token's vectors for one of K or V in one layer."""
        if not self.quantized:
            return kv_heads * head_dim * self.bits / 8
        groups = head_dim // self.group_size
        return kv_heads * (head_dim * self.bits / 8 + groups * 2 * 2)  # fp16 scale + bias


FORMATS = {
    "fp32": KVFormat("fp32", 32),
    "fp16": KVFormat("fp16", 16),
    "q8": KVFormat("q8", 8),
    "q4": KVFormat("q4", 4),
    "q3": KVFormat("q3", 3),
    "q2": KVFormat("q2", 2),
}


def get_format(name: str | KVFormat) -> KVFormat:
    if isinstance(name, KVFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r} (known: {', '.join(FORMATS)})") from None

"""The affine codec: how one side of a page (keys or values) is stored, at full
precision or in affine groups.

A codec stores vectors [B, kv_heads, tokens, head_dim]. Affine codecs group values
along head_dim (per token), or, for keys, along tokens (per channel, as KIVI does:
key outliers live in fixed channels). Either way `scores` and `weighted` compute
q K^T and p V straight on the stored form with `quantized_matmul`, and
`bytes_per_token` is the exact storage cost.

A rotated affine codec first turns each KV head by the fixed random Hadamard rotation
of kvexec/rotated.py (orthogonal, so q K^T is unchanged when q turns too): outliers
spread over every coordinate, so per-token groups lose less. Scores rotate q once per
block, p V is rotated back once; the rotation costs no storage. kvexec/formats.py names
the formats built from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kvexec.kernels import ROWS_KERNEL_MAX, channels_dequantized, dequantized, rows_kernel
from kvexec.rotated import rotation, unrotate


def _rotation(x: mx.array) -> mx.array:
    return rotation(x.shape[1], x.shape[-1])


@dataclass(frozen=True)
class Codec:
    """How one side of a page (keys or values) is stored: full precision or affine groups."""

    bits: int  # 16 or 32: full precision
    group_size: int = 32
    per_channel: bool = False  # groups run along tokens instead of head_dim
    rotated: bool = False  # quantized in the space of kvexec.rotated.rotation (see module doc)

    @property
    def quantized(self) -> bool:
        """Whether values are quantized rather than kept in fp16 or fp32."""
        return self.bits < 16

    @property
    def tokens_last(self) -> bool:
        """Stored [.., head_dim, tokens]: per-channel groups run along the last axis."""
        return self.per_channel and self.quantized

    def encode(self, x: mx.array) -> dict[str, mx.array]:
        """`x` in stored form: itself in fp16 or fp32, or packed weights with fp16 scales and biases."""
        if not self.quantized:
            return {"x": x.astype(mx.float16 if self.bits == 16 else mx.float32)}
        x = x.astype(mx.float32)
        if self.rotated:
            x = x @ _rotation(x)
        if self.per_channel:
            x = x.swapaxes(-1, -2)
        w, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return {"w": w, "scales": scales.astype(mx.float16), "biases": biases.astype(mx.float16)}

    def decode(self, enc: dict[str, mx.array]) -> mx.array:
        """The stored form back as fp32 vectors."""
        if not self.quantized:
            return enc["x"].astype(mx.float32)
        x = channels_dequantized(self.native_parts(enc), self.group_size, enc["w"].shape[-2]) \
            if self.per_channel else None
        if x is None:
            x = dequantized(enc, self.group_size, self.bits)
            x = x.swapaxes(-1, -2) if self.per_channel else x
        return x @ _rotation(x).swapaxes(-1, -2) if self.rotated else x

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
        """Zeroed storage for `capacity` tokens of `head_dim`-wide vectors under leading dims `lead`."""
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
        """The stored form of tokens [start, end) in `storage`: the stored arrays themselves
        when that is all of them (a full segment: no slice, and the native kernels read the
        evaluated, row-contiguous storage in place)."""
        if self.tokens_last:
            spans = {name: self._span(name, start, end) for name in storage}
            if all(a == 0 and b == storage[name].shape[-1] for name, (a, b) in spans.items()):
                return dict(storage)
            return {name: a[..., slice(*spans[name])] for name, a in storage.items()}
        if start == 0 and all(end == a.shape[-2] for a in storage.values()):
            return dict(storage)
        return {name: a[..., start:end, :] for name, a in storage.items()}

    def scores(self, q: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """q @ K^T on the stored form."""
        if not self.quantized:
            return q @ enc["x"].astype(q.dtype).swapaxes(-1, -2)
        if self.rotated:
            q = q @ _rotation(q)
        if self.per_channel:  # stored [.., head_dim, tokens]: the untransposed product
            return self._untransposed(q, enc)
        return mx.quantized_matmul(q, enc["w"], enc["scales"], enc["biases"], transpose=True,
                                   group_size=self.group_size, bits=self.bits)

    def weighted(self, p: mx.array, enc: dict[str, mx.array], rotate: bool = True) -> mx.array:
        """p @ V on the stored form (values are stored per token). rotate=False leaves a
        rotated codec's product in the rotated space: a sum of such products is rotated
        back once (`unrotate`), not once per block."""
        if not self.quantized:
            return p @ enc["x"].astype(p.dtype)
        out = self._untransposed(p, enc)
        return unrotate(out) if self.rotated and rotate else out

    def _untransposed(self, x: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """x @ dequantize(stored): JustFit's native kernel for a few float32 rows on the
        CPU (MLX's reads pages slowly there), else MLX's quantized_matmul."""
        ext = rows_kernel()
        if (ext is not None and x.dtype == mx.float32 and x.shape[-2] <= ROWS_KERNEL_MAX
                and self.bits in getattr(ext, "ROWS_BITS", (4, 8)) and x.ndim == enc["w"].ndim):
            return ext.quantized_matmul_rows(x, enc["w"], enc["scales"], enc["biases"], self.group_size, self.bits)
        return mx.quantized_matmul(x, enc["w"], enc["scales"], enc["biases"], transpose=False,
                                   group_size=self.group_size, bits=self.bits)

    @property
    def native_layout(self) -> list | None:
        """Keys stored per channel as the native kernels take them: per part, the storage
        names of its codes, scales and biases, its bits and its columns (None: all, in
        order); None for other layouts."""
        return [("w", "scales", "biases", self.bits, None)] if self.tokens_last else None

    def native_parts(self, storage: dict[str, mx.array]) -> list | None:
        """`native_layout` with the storage's arrays: [(w, scales, biases, bits, columns)]."""
        layout = self.native_layout
        return None if layout is None else [(storage[w], storage[s], storage[b], n, c) for w, s, b, n, c in layout]

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Storage bytes of one token over `kv_heads` heads, scales and biases included."""
        if not self.quantized:
            return kv_heads * head_dim * self.bits / 8
        return kv_heads * head_dim * (self.bits / 8 + 4 / self.group_size)  # fp16 scale + bias

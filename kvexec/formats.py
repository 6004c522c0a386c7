"""How pages store K and V: full precision or affine group quantization.

A codec stores vectors [B, kv_heads, tokens, head_dim]. Affine codecs group values
along head_dim (per token), or, for keys, along tokens (per channel, as KIVI does:
key outliers live in fixed channels). Either way `scores` and `weighted` compute
q K^T and p V straight on the stored form with `quantized_matmul`, and
`bytes_per_token` is the exact storage cost.

A rotated affine codec first turns each KV head by the fixed random Hadamard rotation
of kvexec/rotated.py (orthogonal, so q K^T is unchanged when q turns too): outliers
spread over every coordinate, so per-token groups lose less. Scores rotate q once per
block, p V is rotated back once; the rotation costs no storage.

Names: the fixed ones in FORMATS, or `k<bits>[c][r][<group>]v<bits>[r][<group>]` (c:
key groups per channel, r: rotated, group default 32), e.g. `k6cr64v4r`; keys with a
calibrated width per channel are `k<mean>a<group>v...~<widths>` (kvexec/allocated.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from kvexec.kernels import ROWS_KERNEL_MAX, channels_dequantized, dequantized, rows_kernel

_NAME = re.compile(r"k(\d)(c?)(r?)(\d*)v(\d)(r?)(\d*)")


def _rotation(x: mx.array) -> mx.array:
    from kvexec.rotated import rotation

    return rotation(x.shape[1], x.shape[-1])


def unrotate(x: mx.array) -> mx.array:
    """A product with rotated values, [B, kv_heads, rows, dim], back in the values' own space."""
    return x @ _rotation(x).swapaxes(-1, -2)


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


@dataclass(frozen=True)
class KVFormat:
    """A named page format: one codec for keys, one for values."""

    name: str
    keys: Codec  # or kvexec.rotated.RotatedCodec: the same interface
    values: Codec

    @property
    def quantized(self) -> bool:
        """Whether keys or values are quantized."""
        return self.keys.quantized or self.values.quantized

    @property
    def label(self) -> str:
        """The name to show: an allocated format's without its per-channel widths."""
        return self.name.partition("~")[0]

    @property
    def token_multiple(self) -> int:
        """Pages must hold a multiple of this many tokens."""
        return self.keys.group_size if self.keys.tokens_last else 1

    def supports_head_dim(self, head_dim: int) -> bool:
        """Groups along head_dim need it to hold whole groups; rotations a power of two."""
        for c in (self.keys, self.values):
            if not c.quantized:
                continue
            if hasattr(c, "supports_head_dim") and not c.supports_head_dim(head_dim):
                return False
            if getattr(c, "rotated", False) and head_dim & (head_dim - 1):
                return False
            if not c.tokens_last and head_dim % getattr(c, "group_size", 32):
                return False
        return True

    def bits_per_value(self, kv_heads: int, head_dim: int) -> float:
        """Storage bits per stored K or V value, every scale, bias and norm included."""
        return 8 * self.bytes_per_token(kv_heads, head_dim) / (2 * kv_heads * head_dim)

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


def parse_format(name: str) -> KVFormat | None:
    """The format a `k<bits>[c][r][<group>]v<bits>[r][<group>]` name describes, else None."""
    if "~" in name:
        from kvexec.allocated import parse_allocated

        codecs = parse_allocated(name)
        return None if codecs is None else KVFormat(name, *codecs)
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    kb, kc, kr, kg, vb, vr, vg = m.groups()
    keys = Codec(int(kb), int(kg or 32), per_channel=bool(kc), rotated=bool(kr))
    values = Codec(int(vb), int(vg or 32), rotated=bool(vr))
    for c in (keys, values):
        if c.bits not in (2, 3, 4, 5, 6, 8) or c.group_size not in (32, 64, 128):
            raise ValueError(f"KV format {name!r}: bits must be 2-6 or 8 and groups 32, 64 or 128")
    return KVFormat(name, keys, values)


def get_format(name: str | KVFormat) -> KVFormat:
    """The format `name` names (a fixed one or a parsed name); a KVFormat is returned as it is."""
    if isinstance(name, KVFormat):
        return name
    fmt = FORMATS.get(name) or parse_format(name)
    from kvexec.config import needs_model  # the config module imports this one

    if fmt is None and needs_model(name):
        raise ValueError(f"KV format {name!r} is chosen per model: calibrate it first (justfit.Engine does, "
                         "or kvexec.calibrate.calibrated_config)")
    if fmt is None:
        raise ValueError(f"unknown KV format {name[:60]!r} (known: {', '.join(FORMATS)}, "
                         "or k<bits>[c][r][<group>]v<bits>[r][<group>])")
    return fmt

"""Page formats: a name for one codec for keys and one for values, and what a name means.

The codecs: full precision or affine groups (kvexec/affine.py), rotated codebooks
(kvexec/rotated.py), keys with a calibrated width per channel (kvexec/allocated.py).

Names: the fixed ones in FORMATS, or `k<bits>[c][r][<group>]v<bits>[r][<group>]` (c:
key groups per channel, r: rotated, group default 32), e.g. `k6cr64v4r`; keys with a
calibrated width per channel are `k<mean>a<group>v...~<widths>` (kvexec/allocated.py);
`calibrated` and an allocated name without its widths are only known per model
(`needs_model`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvexec.affine import Codec
from kvexec.allocated import TEMPLATE, parse_allocated
from kvexec.rotated import RotatedCodec

_NAME = re.compile(r"k(\d)(c?)(r?)(\d*)v(\d)(r?)(\d*)")

# A format resolved per model at load: each layer's pages in the smallest candidate of
# kvexec.calibrate.CANDIDATES within `calibration_tolerance` (kvexec/calibrate.py).
CALIBRATED = "calibrated"


def needs_model(name: str) -> bool:
    """Whether format `name` is only known once a model is calibrated: "calibrated", or an
    allocated format (`k<mean>a<group>v...`) before its per-channel widths."""
    return name == CALIBRATED or TEMPLATE.fullmatch(name) is not None


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
    if fmt is None and needs_model(name):
        raise ValueError(f"KV format {name!r} is chosen per model: calibrate it first (justfit.Engine does, "
                         "or kvexec.calibrate.calibrated_config)")
    if fmt is None:
        raise ValueError(f"unknown KV format {name[:60]!r} (known: {', '.join(FORMATS)}, "
                         "or k<bits>[c][r][<group>]v<bits>[r][<group>])")
    return fmt

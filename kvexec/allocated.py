"""Keys with a bit width per channel, chosen for the model (the allocated key codec).

A key's quantization error reaches attention through q . k: channel c costs about
E[q_c^2] times its step squared, and the step is the channel's range over a group of
tokens over 2^bits - 1. Channels differ by orders of magnitude in both (RoPE'd keys keep
their outliers in a few fixed channels, and the queries' large channels are the same
ones), so equal widths spend bits on channels that barely move a score. Given each
channel's weight w_c = E[q_c^2] E[range_c^2], measured once per model on a fixed text
(kvexec/calibrate.py), `allocate_widths` hands out bits one at a time where they cut
sum_c w_c / (2^b_c - 1)^2 most (reverse water-filling over MLX's widths 2-6 and 8).

Storage is per channel (groups along tokens, as the `c` formats): the channels of one
width form one array [.., kv_heads, channels, tokens], so every KV head holds the same
number of channels at each width (each head ranks its own channels). Scores are one
untransposed product per width, on the query's matching channels, summed.

Name: `k<mean>a<group>v<bits>[r][<group>]~<widths>`, the widths one digit per channel
and heads separated by ".": the name alone rebuilds the codec wherever a format name
travels (per-layer formats, snapshots, exports). `label` drops the widths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from kvexec.affine import Codec
from kvexec.kernels import ROWS_KERNEL_MAX, channels_dequantized, rows_kernel

WIDTHS = (2, 3, 4, 5, 6, 8)  # what mx.quantize stores
NAME = re.compile(r"k(\d)a(\d+)v(\d)(r?)(\d*)~([2-8.]+)")
TEMPLATE = re.compile(r"k(\d)a(\d+)v\d+r?\d*")  # an allocated name before calibration chose its widths


def channel_weights(queries: np.ndarray, keys: np.ndarray, group_size: int) -> np.ndarray:
    """w [kv_heads, head_dim]: mean squared query (over the heads sharing each KV head and
    every position) times mean squared key range over groups of `group_size` tokens.
    queries [heads, tokens, head_dim], keys [kv_heads, tokens, head_dim]."""
    kvh, n, d = keys.shape
    q2 = (queries.astype(np.float64) ** 2).reshape(kvh, -1, d).mean(axis=1)
    m = max(group_size, n // group_size * group_size)
    k = keys[:, :m].astype(np.float64).reshape(kvh, -1, min(group_size, m), d)
    return q2 * ((k.max(axis=2) - k.min(axis=2)) ** 2).mean(axis=1)


def _greedy(weights: np.ndarray, mean_bits: int) -> np.ndarray:
    """Integer widths for channels of these weights, summing to mean_bits per channel."""
    bits = np.full(len(weights), WIDTHS[0])
    budget = mean_bits * len(weights) - bits.sum()
    cost = lambda b: weights / (2.0**b - 1) ** 2  # noqa: E731
    while budget > 0:
        nxt = np.array([WIDTHS[min(WIDTHS.index(b) + 1, len(WIDTHS) - 1)] for b in bits])
        step = nxt - bits
        gain = (cost(bits) - cost(nxt)) / np.maximum(step, 1)
        gain[(step == 0) | (step > budget)] = -1.0
        j = int(gain.argmax())
        if gain[j] < 0:
            break
        budget -= step[j]
        bits[j] = nxt[j]
    if budget:
        raise ValueError(f"cannot spend {mean_bits} bits per channel in widths {WIDTHS}")
    return bits


def allocate_widths(weights: np.ndarray, mean_bits: int) -> tuple[tuple[int, ...], ...]:
    """Per KV head, a width per channel: `mean_bits` on average, the same number of channels
    at each width in every head. The widths are allocated on the heads' rank profile (the
    geometric mean of each head's weights sorted high to low) and each head gives them to
    its own channels by rank."""
    if mean_bits not in WIDTHS[:-1]:
        raise ValueError(f"mean bits must be one of {WIDTHS[:-1]}, not {mean_bits}")
    w = np.maximum(np.asarray(weights, dtype=np.float64), 1e-30)
    order = np.argsort(-w, axis=1, kind="stable")
    profile = np.exp(np.log(np.take_along_axis(w, order, axis=1)).mean(axis=0))
    by_rank = _greedy(profile, mean_bits)
    out = []
    for h in range(w.shape[0]):
        widths = np.empty(w.shape[1], dtype=int)
        widths[order[h]] = by_rank
        out.append(tuple(int(b) for b in widths))
    return tuple(out)


def widths_text(widths: tuple[tuple[int, ...], ...]) -> str:
    """The widths as a name carries them: one digit per channel, heads joined by "."."""
    return ".".join("".join(str(b) for b in head) for head in widths)


@dataclass(frozen=True)
class AllocatedCodec:
    """Keys stored per channel, each channel at its own width (see module doc)."""

    widths: tuple[tuple[int, ...], ...]  # per KV head, bits per channel
    group_size: int = 128
    quantized = True
    tokens_last = True  # [.., channels, tokens]: per-channel groups along the last axis
    per_channel = True
    rotated = False

    def __post_init__(self) -> None:
        if not self.widths or any(len(h) != len(self.widths[0]) for h in self.widths):
            raise ValueError("allocated key widths need one equal-length row per KV head")
        if any(b not in WIDTHS for h in self.widths for b in h):
            raise ValueError(f"allocated key widths must be among {WIDTHS}")
        counts = {b: self.widths[0].count(b) for b in set(self.widths[0])}
        if any({b: h.count(b) for b in set(h)} != counts for h in self.widths):
            raise ValueError("every KV head must hold the same number of channels at each width")
        if self.group_size not in (32, 64, 128):
            raise ValueError("allocated key groups must be 32, 64 or 128 tokens")

    @property
    def bits(self) -> float:
        """Mean bits per stored value, before scales and biases."""
        return sum(self.widths[0]) / len(self.widths[0])

    @cached_property
    def _classes(self) -> list[tuple[int, Codec, mx.array]]:
        """(width, its per-channel codec, channel indices [kv_heads, n]) from widest down."""
        out = []
        for b in sorted(set(self.widths[0]), reverse=True):
            idx = np.array([[c for c, w in enumerate(h) if w == b] for h in self.widths], dtype=np.int32)
            out.append((b, Codec(b, self.group_size, per_channel=True), mx.array(idx)))
        return out

    @cached_property
    def _units(self) -> dict[str, int]:
        """Storage name -> units along the token axis per group of tokens (packed words or one)."""
        out = {}
        for b, _, _ in self._classes:
            out.update({f"b{b}.w": self.group_size * b // 32, f"b{b}.scales": 1, f"b{b}.biases": 1})
        return out

    @cached_property
    def native_layout(self) -> list:
        """Per width, widest first: the storage names of its codes, scales and biases, its
        bits and its channels [kv_heads, n] (the native kernels' parts)."""
        return [(f"b{b}.w", f"b{b}.scales", f"b{b}.biases", b, idx) for b, _, idx in self._classes]

    @cached_property
    def _inverse(self) -> mx.array:
        """[kv_heads, head_dim]: where each channel sits in the classes' concatenation."""
        order = np.concatenate([np.array(idx) for _, _, idx in self._classes], axis=1)
        return mx.array(np.argsort(order, axis=1).astype(np.int32))

    def supports_head_dim(self, head_dim: int) -> bool:
        """Only the head_dim the widths were allocated for."""
        return head_dim == len(self.widths[0])

    def _check(self, kv_heads: int, head_dim: int) -> None:
        if kv_heads != len(self.widths) or head_dim != len(self.widths[0]):
            raise ValueError(f"allocated keys for {len(self.widths)} x {len(self.widths[0])} channels, "
                             f"given {kv_heads} x {head_dim}")

    @staticmethod
    def _pick(x: mx.array, idx: mx.array) -> mx.array:
        """x[..., h, :, idx[h]]: each KV head's channels of one width."""
        return mx.take_along_axis(x, idx[None, :, None, :], axis=-1)

    @staticmethod
    def _part(enc: dict[str, mx.array], b: int) -> dict[str, mx.array]:
        return {name.partition(".")[2]: a for name, a in enc.items() if name.partition(".")[0] == f"b{b}"}

    def encode(self, x: mx.array) -> dict[str, mx.array]:
        """`x` [B, kv_heads, tokens, head_dim] stored: per width, its channels' packed groups."""
        self._check(x.shape[1], x.shape[-1])
        x = x.astype(mx.float32)
        out = {}
        for b, codec, idx in self._classes:
            out.update({f"b{b}.{k}": v for k, v in codec.encode(self._pick(x, idx)).items()})
        return out

    def decode(self, enc: dict[str, mx.array]) -> mx.array:
        """The stored keys back as fp32 [B, kv_heads, tokens, head_dim]."""
        native = channels_dequantized(self.native_parts(enc), self.group_size, len(self.widths[0]))
        if native is not None:
            return native
        parts = [codec.decode(self._part(enc, b)) for b, codec, _ in self._classes]
        return self._pick(mx.concatenate(parts, axis=-1), self._inverse)

    def allocate(self, lead: tuple[int, ...], capacity: int, head_dim: int) -> dict[str, mx.array]:
        """Zeroed storage for `capacity` tokens under leading dims `lead` ([B, kv_heads])."""
        self._check(lead[-1], head_dim)
        out = {}
        for b, codec, idx in self._classes:
            out.update({f"b{b}.{k}": v for k, v in codec.allocate(lead, capacity, idx.shape[-1]).items()})
        return out

    def write(self, storage: dict[str, mx.array], enc: dict[str, mx.array], start: int, n: int) -> None:
        """Write n encoded tokens in place at token index `start` (a group boundary)."""
        for b, codec, _ in self._classes:
            codec.write(self._part(storage, b), self._part(enc, b), start, n)

    def view(self, storage: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
        """The stored form of tokens [start, end) (group boundaries). One pass: decode visits
        every block's view each step."""
        a, b = start // self.group_size, end // self.group_size
        return {name: arr[..., a * self._units[name] : b * self._units[name]] for name, arr in storage.items()}

    def scores(self, q: mx.array, enc: dict[str, mx.array]) -> mx.array:
        """q [B, kv_heads, rows, head_dim] @ K^T: JustFit's native product over every width
        at once for a few float32 rows on the CPU, else one untransposed product per width."""
        ext = rows_kernel()
        if (ext is not None and hasattr(ext, "quantized_matmul_rows_split") and q.dtype == mx.float32
                and q.shape[-2] <= ROWS_KERNEL_MAX):
            w, scales, biases, bits, columns = zip(*self.native_parts(enc))
            return ext.quantized_matmul_rows_split(q, list(w), list(scales), list(biases), list(columns),
                                                   self.group_size, list(bits))
        out = None
        for b, codec, idx in self._classes:
            s = codec._untransposed(self._pick(q, idx), self._part(enc, b))
            out = s if out is None else out + s
        return out

    def native_parts(self, storage: dict[str, mx.array]) -> list:
        """`native_layout` with the storage's arrays: [(w, scales, biases, bits, columns)]."""
        return [(storage[w], storage[s], storage[b], n, idx) for w, s, b, n, idx in self.native_layout]

    def weighted(self, p: mx.array, enc: dict[str, mx.array], rotate: bool = True) -> mx.array:
        """Values are never stored this way (their error is not weighted by queries)."""
        raise TypeError("the allocated codec stores keys only")

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Storage bytes of one token over `kv_heads` heads: every width's codes, and an
        fp16 scale and bias per channel per group of tokens."""
        return kv_heads * sum(b / 8 + 4 / self.group_size for b in self.widths[0])


def parse_allocated(name: str):
    """The (keys, values) codecs a `k<mean>a<group>v...~<widths>` name describes, else None."""
    m = NAME.fullmatch(name)
    if m is None:
        return None
    mean, group, vbits, vrot, vgroup, text = m.groups()
    widths = tuple(tuple(int(c) for c in head) for head in text.split("."))
    keys = AllocatedCodec(widths, int(group))
    if any(sum(h) != int(mean) * len(h) for h in widths):
        raise ValueError(f"KV format {name[:40]}...: the widths do not average {mean} bits")
    values = Codec(int(vbits), int(vgroup or 32), rotated=bool(vrot))
    if values.bits not in WIDTHS or values.group_size not in (32, 64, 128):
        raise ValueError(f"KV format {name[:40]}...: value bits must be 2-6 or 8 and groups 32, 64 or 128")
    return keys, values

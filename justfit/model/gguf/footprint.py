"""What converting a GGUF file holds in memory, predicted from its header alone (tensor
types and shapes, the vocabulary's size): the converter (justfit.model.gguf.convert)
keeps every converted tensor in MLX until the folder is written, so its peak is, over the
tensors in file order, what is converted before one plus what converting that one holds
(its file pages, the numpy forms and their MLX copy); the metadata's Python objects stay
throughout (a converted tensor's file pages are dropped). The tokenizer is built after
the weights are freed."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from justfit.model.gguf.blocks import EXACT_TYPES, GROUP
from justfit.model.gguf.file import Skipped
from justfit.model.gguf.options import RequantOptions

_FLOAT = (QT.F32, QT.F16, QT.BF16)
_NATIVE = (QT.Q4_0, QT.Q4_1, QT.Q8_0)
_BITS = {QT.Q8_0: 8, QT.Q4_0: 4, QT.Q4_1: 4, QT.Q5_0: 5, QT.Q5_1: 5, QT.Q4_K: 4, QT.Q5_K: 5}
# Bytes per weight the translation's numpy temporaries hold at once beside the file's
# bytes (blocks.py): a byte of codes per weight, the nibbles' halves and their join,
# the 5th bit unpacked, and 5-bit packing's bitstream (a byte per bit, then its slice).
_TEMPORARIES = {QT.Q8_0: 1, QT.Q4_0: 2, QT.Q4_1: 2, QT.Q5_0: 13, QT.Q5_1: 13, QT.Q4_K: 3, QT.Q5_K: 13}
# Re-quantized types: float32 values from the `gguf` package's dequantization (and its
# own temporaries), their float32 copy, MLX's copy, and the quantized outputs.
_REQUANT_TEMPORARIES = 16
# CPython's object sizes (64-bit): a list slot, a str besides its characters (its
# header, 49 bytes for ASCII and 74 for wider pieces, and pymalloc's rounding), a float;
# small ints (token types) are shared.
_SLOT, _STR, _FLOAT_OBJ = 8, 96, 24
# Building a `tokenizers` tokenizer, per vocabulary entry, by GGUF tokenizer model: a
# byte-level BPE's vocabulary and merges as the library's maps; a SentencePiece one's
# also the merges derived from its scores, ranked in Python first (justfit.model.gguf.tokenizer).
_TOKENIZER_PER_ENTRY = {"gpt2": 640, "llama": 1250}


@dataclass(frozen=True)
class ConversionFootprint:
    """A conversion's predicted peak above what the process held before it, in bytes, by part."""

    weights: int  # converted tensors held in MLX at the peak
    tensor: int  # what converting the tensor at the peak holds besides them (file pages, numpy forms, MLX copy)
    metadata: int  # the header's Python objects (vocabulary strings, scores, merges)
    tokenizer: int  # building the tokenizer after the weights are freed (the `tokenizers` library's)
    converted: int  # every converted tensor's bytes: the folder's weights

    @property
    def peak(self) -> int:
        """The larger of converting the weights and building the tokenizer, the metadata beside either."""
        return self.metadata + max(self.weights + self.tensor, self.tokenizer)

    def parts(self) -> dict[str, int]:
        """The terms at the peak, by name."""
        if self.weights + self.tensor >= self.tokenizer:
            return {"converted weights": self.weights, "tensor being converted": self.tensor,
                    "GGUF metadata": self.metadata}
        return {"tokenizer build": self.tokenizer, "GGUF metadata": self.metadata}


def tensor_bytes(qtype: QT, shape: tuple[int, ...], name: str, opts: RequantOptions) -> tuple[int, int]:
    """(bytes the converted tensor keeps, bytes converting it holds at once, its own kept
    bytes included) for a tensor of GGUF `qtype` and `shape` (GGUF order)."""
    n = _count(shape)
    block, size = GGML_QUANT_SIZES[qtype]
    source = n // block * size  # its file pages, read while it converts
    if qtype in _FLOAT:
        kept = n * (4 if qtype != QT.F16 else 2)
        return kept, source + 2 * kept
    groups = n // GROUP
    if qtype in _NATIVE or (opts.bits in ("exact", "native") and qtype in EXACT_TYPES):
        scale = 4 if qtype in (QT.Q4_K, QT.Q5_K) else 2  # K-quants' scales and biases stay float32
        kept = n * _BITS[qtype] // 8 + 2 * groups * scale
        return kept, max(source + n * _TEMPORARIES[qtype], 2 * kept)
    if opts.bits == "exact":
        return 4 * n, source + _REQUANT_TEMPORARIES * n
    bits = opts.embed_bits if name == "token_embd.weight" else 8 if opts.bits == "native" else int(opts.bits)
    kept = n * bits // 8 + 2 * groups * 2
    return kept, source + _REQUANT_TEMPORARIES * n + kept


def metadata_bytes(meta: dict) -> int:
    """The Python objects the converter's full read of this header holds (its arrays)."""
    total = 0
    for value in meta.values():
        if isinstance(value, Skipped):
            each = {"s": _STR, "f": _FLOAT_OBJ, "d": _FLOAT_OBJ}.get(value.kind, 0)
            total += value.count * (_SLOT + each) + (value.nbytes if value.kind == "s" else 0)
    return total


def header_footprint(meta: dict, tensors: list, opts: RequantOptions) -> ConversionFootprint:
    """The predicted peak of converting a GGUF file with `opts`, from its header
    (justfit.model.gguf.file.read_header's metadata and tensors)."""
    held, converted, peak, at_peak = 0, 0, 0, (0, 0)
    for name, qtype, shape in tensors:
        kept, holds = tensor_bytes(qtype, shape, name, opts)
        if held + holds > peak:
            peak, at_peak = held + holds, (held, holds)
        held += kept
        converted += kept
    return ConversionFootprint(at_peak[0], at_peak[1], metadata_bytes(meta), tokenizer_bytes(meta), converted)


def tokenizer_bytes(meta: dict) -> int:
    """What building the `tokenizers` tokenizer holds (`_TOKENIZER_PER_ENTRY`)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    per = _TOKENIZER_PER_ENTRY.get(meta.get("tokenizer.ggml.model"), max(_TOKENIZER_PER_ENTRY.values()))
    return per * (len(tokens) if tokens is not None else 0)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

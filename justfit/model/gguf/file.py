"""A fast GGUF reader: metadata and memory-mapped tensor views.

gguf-py's GGUFReader builds numpy views for every array element, slow on a large
vocabulary; this walks the header once with `struct` instead.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

_MAGIC = b"GGUF"
# GGUF value type -> struct format (12 and 13 are 64-bit ints, 12 signed... per spec)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its name, type, shape and data."""

    name: str
    tensor_type: QT
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # float array in row-major shape, or raw blocks (rows, bytes)
    source: mmap.mmap | None = None  # the file's mapping `data` lies in, and where
    offset: int = 0

    def drop_pages(self) -> None:
        """Take the file's pages out of the process's resident memory (the kernel's page
        cache keeps them; `data` reads them back if touched again): a converted tensor's
        source need not count beside its copy. The whole file's, not only this tensor's:
        the kernel maps the pages around a read too, and the file's order is not the
        order tensors are read in, so the pages of tensors converted earlier would stay."""
        if self.source is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        self.source.madvise(mmap.MADV_DONTNEED)


class GGUFFormatError(ValueError):
    """A file that is not GGUF this reader can read."""
    pass


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise GGUFFormatError("truncated GGUF header")
    return struct.unpack("<" + fmt, raw)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "Q")
    return f.read(n).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Skipped:
    """An array `read_header` stepped over: its length, its bytes in the file (a string
    array: its strings' alone) and its elements' kind ("s": strings, else a struct format)."""

    count: int
    nbytes: int
    kind: str

    def __len__(self) -> int:
        return self.count


def _skip_strings(f: BinaryIO, count: int) -> Skipped:
    total = 0
    for _ in range(count):
        n = _read(f, "Q")
        f.seek(n, 1)
        total += n
    return Skipped(count, total, "s")


def _value(f: BinaryIO, vtype: int, skip: bool = False) -> Any:
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, count = _read(f, "I"), _read(f, "Q")
        if etype == _STRING:
            return _skip_strings(f, count) if skip else [_string(f) for _ in range(count)]
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            raw = f.read(struct.calcsize(fmt) * count)
            return Skipped(count, len(raw), fmt) if skip else list(struct.unpack(f"<{count}{fmt}", raw))
        return [_value(f, etype, skip) for _ in range(count)]
    if vtype not in _SCALARS:
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")
    return _read(f, _SCALARS[vtype])


def _header(f: BinaryIO, path: str, skip: bool) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    if f.read(4) != _MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file")
    version = _read(f, "I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = _read(f, "Q"), _read(f, "Q")
    meta = {}
    for _ in range(n_kv):
        key = _string(f)
        meta[key] = _value(f, _read(f, "I"), skip)
    infos = []
    for _ in range(n_tensors):
        name = _string(f)
        dims = tuple(_read(f, "Q") for _ in range(_read(f, "I")))
        infos.append((name, dims, _read(f, "I"), _read(f, "Q")))
    return meta, infos


def read_header(path: str) -> tuple[dict[str, Any], list[tuple[str, QT, tuple[int, ...]]]]:
    """(metadata, (name, type, shape) per tensor) of a GGUF file, its arrays stepped over
    (`Skipped`): what a prediction reads without holding a vocabulary's strings."""
    with open(path, "rb") as f:
        meta, infos = _header(f, path, skip=True)
    return meta, [(name, QT(ttype), dims) for name, dims, ttype, _ in infos]


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF v2/v3 file; tensor data is memory-mapped."""
    with open(path, "rb") as f:
        meta, infos = _header(f, path, skip=False)
        align = int(meta.get("general.alignment", 32))
        start = (f.tell() + align - 1) // align * align
        source = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm = np.frombuffer(source, dtype=np.uint8)
    tensors = []
    for name, dims, ttype, offset in infos:
        qtype = QT(ttype)
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        block, nbytes = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * nbytes
        at = start + offset
        raw = mm[at : at + rows * row_bytes]
        if qtype in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[qtype]).reshape(tuple(reversed(dims)))
        else:
            data = raw.reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, qtype, dims, data, source, at))
    return meta, tensors

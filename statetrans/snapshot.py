"""The on-disk snapshot, and reading it back: a safetensors file of arrays and a JSON
manifest that names the format version, what the state belongs to, and the size and
sha256 of the arrays (mandatory); the arrays carry the hash of the rest of the
manifest, so neither can be edited or swapped alone. KV pages already on disk may be
linked page files (`pages-*.bin`) the manifest names part by part, each with its
sha256. Writing and publishing are statetrans.publish.

Reading trusts nothing a file says before checking it: a manifest is read only up to
`MAX_JSON` bytes, its nesting checked against `MAX_DEPTH` before it is parsed, numbers
bounded (no NaN or Infinity, no thousand-digit integers) and every field the format
defines checked for type and range; the arrays file's safetensors header is read on
its own and every array checked to lie inside the file, none overlapping, so loading
allocates at most the file's size; a linked page file must be a regular file inside
the snapshot, its parts inside it and not overlapping. Every failure is a
SnapshotError, which says whether the snapshot is damaged (to quarantine) or only
could not be read now.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from kvexec.disk_pages import Extent, PageFile, SpilledPart

from statetrans.bounded_json import bounded_loads

FORMAT = "justfit-state"
VERSION = 1
ARRAYS = "arrays.safetensors"
MANIFEST = "manifest.json"
ARRAYS_NAME = re.compile(r"^arrays(?:-[0-9a-f]{8,64})?\.safetensors$")
PAGES_NAME = re.compile(r"^pages-[0-9a-f]{8,64}\.bin$")
MAX_PAGE_FILES = 1024  # page files one snapshot links (a state's pages sit in one or two)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

# The most a manifest (or a safetensors header) may take: token ids cost at most 11
# bytes each ("2147483647,"), so 64 MiB holds about 6 million of them with room for the
# layers' metadata; a larger file is refused unread.
MAX_JSON = 64 << 20
MAX_DEPTH = 64  # nesting of JSON objects and arrays (a manifest needs 6, a chat transcript riding along about 8)
MAX_DIGITS = 64  # of a JSON integer (a sampler seed may be a client's 64-bit one)
MAX_TEXT = 1 << 16  # characters of a name, a model path or a KV format
TOKEN_LIMIT = 2**31  # token ids are below this (and below the model's vocabulary where known)
# safetensors dtypes MLX reads: name -> (MLX's name, bytes per element)
DTYPES = {"BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "U16": ("uint16", 2), "I16": ("int16", 2),
          "F16": ("float16", 2), "BF16": ("bfloat16", 2), "U32": ("uint32", 4), "I32": ("int32", 4),
          "F32": ("float32", 4), "U64": ("uint64", 8), "I64": ("int64", 8), "F64": ("float64", 8),
          "C64": ("complex64", 8)}
MAX_DIMS = 8
MAX_DIM = 2**31

Shapes = dict[str, tuple[str, tuple[int, ...]]]  # array name -> (dtype, shape)


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded: missing, damaged, or for something else.
    `damaged`: the files themselves are wrong (quarantine them), not merely unreadable
    now (gone meanwhile, permissions, I/O); `stamp`: (device, inode) of the snapshot
    folder that was read, so a quarantine moves that one and not a newer one."""

    def __init__(self, message: str, damaged: bool = True):
        super().__init__(message)
        self.damaged = damaged
        self.stamp: tuple[int, int] | None = None


def parse_json(data: bytes, what: str):
    """`data` parsed as JSON of bounded size, depth and numbers; raises SnapshotError
    naming `what` otherwise (never RecursionError, OverflowError or MemoryError)."""
    if len(data) > MAX_JSON:
        raise SnapshotError(f"{what}: {len(data)} bytes, more than the {MAX_JSON >> 20} MiB a snapshot's JSON may take")
    try:
        return bounded_loads(data.decode("utf-8"), MAX_DEPTH, MAX_DIGITS)
    except (ValueError, RecursionError, MemoryError) as e:  # RecursionError/MemoryError: belt and braces
        raise SnapshotError(f"{what} ({type(e).__name__}: {str(e)[:200]})") from None


def _os_error(e: OSError, what: str) -> SnapshotError:
    """A SnapshotError for an OSError met reading `what`: a symbolic link where a file
    belongs is damage; the rest (permissions, I/O, gone) only says it cannot be read now."""
    if e.errno == 40:  # ELOOP: O_NOFOLLOW met a link
        return SnapshotError(f"{what} is a symbolic link, not a snapshot's file")
    return SnapshotError(f"cannot read {what} ({e.strerror or e})", damaged=False)


def _open_regular(path: Path) -> int:
    """A read descriptor on regular file `path` (never following a link, never blocking
    on a FIFO or device); raises SnapshotError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _os_error(e, str(path)) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise _os_error(e, str(path)) from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SnapshotError(f"{path} is not a regular file")
    return fd


def _read_at(fd: int, n: int, offset: int, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        try:
            block = os.pread(fd, min(n - len(out), 1 << 20), offset + len(out))
        except OSError as e:
            raise _os_error(e, what) from None
        if not block:
            raise SnapshotError(f"{what} ends early")
        out += block
    return bytes(out)


def read_json_file(path: Path, what: str):
    """The JSON in regular file `path` (at most MAX_JSON bytes, bounded as parse_json
    does); FileNotFoundError when there is none, SnapshotError when it is not sound."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_JSON:
            raise SnapshotError(f"{what}: {size} bytes, more than the {MAX_JSON >> 20} MiB a snapshot's JSON may take")
        return parse_json(_read_at(fd, size, 0, what), what)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path` (the manifest names its arrays file's)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_fd(fd: int, size: int, what: str, start: int = 0) -> str:
    h = hashlib.sha256()
    for offset in range(0, size, 1 << 20):
        h.update(_read_at(fd, min(1 << 20, size - offset), start + offset, what))
    return h.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """Hash of everything the manifest says except the file checksums; kept inside the
    arrays file, so an edited manifest (other tokens, other layers) is caught."""
    core = {k: v for k, v in manifest.items() if k != "files"}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def snapshot_bytes(path: str | os.PathLike) -> int:
    """Bytes the snapshot at `path` takes on disk (its regular files; links are not followed)."""
    total = 0
    for f in Path(path).expanduser().iterdir():
        st = f.lstat()
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def _text(value, what: str, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"'{what}' must be text of at most {MAX_TEXT} characters")


def _count(value, what: str, optional: bool = True, limit: int = 2**63) -> None:
    if value is None and optional:
        return
    if type(value) is not int or not 0 <= value < limit:
        raise ValueError(f"'{what}' must be an integer in [0, {limit})")


def check_tokens(tokens, limit: int = TOKEN_LIMIT) -> None:
    """Token ids: a list of integers in [0, limit); raises ValueError."""
    if not isinstance(tokens, list):
        raise ValueError("'tokens' must be a list of token ids")
    if not all(type(t) is int and 0 <= t < limit for t in tokens):
        raise ValueError(f"'tokens' holds something other than token ids below {limit}")


def _check_fields(m: dict) -> None:
    """Type and range of every field the snapshot format defines (what a state is for
    is checked by its reader: statetrans.schema); raises ValueError."""
    if "tokens" in m:
        check_tokens(m["tokens"])
    for key in ("model", "model_name", "policy", "session", "scope"):
        _text(m.get(key), key)
    if m.get("kv") is not None and not isinstance(m["kv"], dict):
        raise ValueError("'kv' must be an object or null")
    for key in ("generation", "positions"):
        _count(m.get(key), key)
    sampler = m.get("sampler")
    if sampler is not None:
        if not isinstance(sampler, dict) or not set(sampler) <= {"seed", "step"} \
                or any(type(v) is not int for v in sampler.values()) or sampler.get("step", 0) < 0:
            raise ValueError("'sampler' must be {} or a seed and a step (integers)")
    owner = m.get("owner")
    if owner is not None:
        if not isinstance(owner, dict) or not set(owner) <= {"pid", "started", "id"}:
            raise ValueError("'owner' must name a pid, its start time and an id")
        _count(owner.get("pid"), "owner.pid", limit=2**31)
        if owner.get("started") is not None and type(owner["started"]) not in (int, float):
            raise ValueError("'owner.started' must be a number")
        _text(owner.get("id"), "owner.id")


def read_manifest(src: Path) -> dict:
    """The manifest of the snapshot at `src`, parsed within bounds and checked for form
    (not checksums: cheap, for indexing). Raises SnapshotError."""
    stamp = stamp_of(src)
    try:
        return _manifest(src)
    except SnapshotError as e:
        e.stamp = e.stamp or stamp
        raise


def stamp_of(src: Path) -> tuple[int, int] | None:
    """(device, inode) of `src` itself (not a link's target); None when it is gone."""
    try:
        st = os.lstat(src)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _manifest(src: Path) -> dict:
    try:
        manifest = read_json_file(src / MANIFEST, f"{src}: damaged manifest")
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {src} (missing {MANIFEST})", damaged=os.path.lexists(src)) from None
    except NotADirectoryError:
        raise SnapshotError(f"no snapshot at {src} (not a folder)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{src}: not a JustFit state snapshot")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"{src}: snapshot format version {str(manifest.get('version'))[:40]}, "
                            f"this JustFit reads {VERSION}")
    _arrays_file(manifest, src)
    _page_entries(manifest, src)
    try:
        _check_fields(manifest)
    except ValueError as e:
        raise SnapshotError(f"{src}: malformed manifest: {e}") from None
    return manifest


def _arrays_file(manifest: dict, src: Path) -> tuple[Path, int, str]:
    """The arrays file the manifest names, with its size and sha256 (mandatory)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise SnapshotError(f"{src}: the manifest has no checksums ('files'); refusing an unverifiable snapshot")
    if len(files) != 1:
        raise SnapshotError(f"{src}: the manifest names {len(files)} files, a snapshot has one arrays file")
    (name, info), = files.items()
    if not isinstance(name, str) or not ARRAYS_NAME.match(name):
        raise SnapshotError(f"{src}: the manifest names an unexpected file {name[:80]!r}")
    if (not isinstance(info, dict) or set(info) != {"sha256", "bytes"} or type(info["bytes"]) is not int
            or not 0 <= info["bytes"] < 2**63
            or not isinstance(info.get("sha256"), str) or not _HEX64.match(info["sha256"])):
        raise SnapshotError(f"{src}: the manifest's checksum entry for {name} is malformed")
    return src / name, info["bytes"], info["sha256"]


def page_names(manifest) -> list[str]:
    """The page files a manifest names (unchecked: what a replaced snapshot keeps)."""
    pages = manifest.get("pages") if isinstance(manifest, dict) else None
    return [n for n in pages if isinstance(n, str)] if isinstance(pages, dict) else []


def _page_entries(manifest: dict, src: Path) -> dict[str, dict[str, tuple[int, str, tuple[int, ...], str]]]:
    """The page files the manifest links and each part it takes from them (array name ->
    offset, dtype, shape, sha256), checked for form (not against the files)."""
    pages = manifest.get("pages", {})
    if not isinstance(pages, dict) or len(pages) > MAX_PAGE_FILES:
        raise SnapshotError(f"{src}: the manifest's 'pages' must map at most {MAX_PAGE_FILES} page files to parts")
    out = {}
    for name, parts in pages.items():
        if not PAGES_NAME.match(name):
            raise SnapshotError(f"{src}: the manifest names an unexpected page file {name[:80]!r}")
        if not isinstance(parts, dict) or not parts:
            raise SnapshotError(f"{src}: page file {name} lists no parts")
        entries = {}
        for key, info in parts.items():
            if len(key) > 512 or not isinstance(info, dict) or set(info) != {"offset", "dtype", "shape", "sha256"}:
                raise SnapshotError(f"{src}: part {key[:60]!r} of {name} is malformed")
            offset, dtype, shape, sha = info["offset"], info["dtype"], info["shape"], info["sha256"]
            if (type(offset) is not int or not 0 <= offset < 2**62 or not isinstance(dtype, str) or dtype not in DTYPES
                    or not isinstance(shape, list) or len(shape) > MAX_DIMS
                    or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape)
                    or not isinstance(sha, str) or not _HEX64.match(sha)):
                raise SnapshotError(f"{src}: part {key[:60]!r} of {name} is malformed")
            entries[key] = (offset, DTYPES[dtype][0], tuple(shape), sha)
        out[name] = entries
    return out


def _part_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * next(size for name, size in DTYPES.values() if name == dtype)


def _open_file_of(src: Path, path: Path) -> int:
    """A read descriptor on the file `path` of the snapshot at `src`; SnapshotError when
    it is missing (damage, unless the snapshot itself is gone) or not a regular file."""
    try:
        return _open_regular(path)
    except FileNotFoundError:
        raise SnapshotError(f"{src}: missing {path.name}", damaged=os.path.lexists(src)) from None


def _check_pages(src: Path, manifest: dict, header: Header, verify: bool) -> None:
    """Add the manifest's page parts to `header`: each file regular, each part inside it,
    none overlapping, none also in the arrays file (with `verify`, each part's sha256)."""
    for name, parts in _page_entries(manifest, src).items():
        path = src / name
        fd = _open_file_of(src, path)
        try:
            size = os.fstat(fd).st_size
            spans = sorted((off, off + _part_bytes(dtype, shape)) for off, dtype, shape, _ in parts.values())
            if spans[-1][1] > size:
                raise SnapshotError(f"{src}: {name} is truncated ({size} bytes, its parts need {spans[-1][1]})")
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                raise SnapshotError(f"{src}: parts of {name} overlap")
            for key, (off, dtype, shape, sha) in parts.items():
                if verify and _sha256_fd(fd, _part_bytes(dtype, shape), str(path), off) != sha:
                    raise SnapshotError(f"{src}: {name} is corrupted (checksum mismatch in {key[:60]})")
        finally:
            os.close(fd)
        for key, (off, dtype, shape, _) in parts.items():
            if key in header.shapes:
                raise SnapshotError(f"{src}: array {key[:60]!r} is given twice")
            header.shapes[key] = (dtype, shape)
            header.pages[key] = (name, off)


def _page_parts(src: Path, manifest: dict) -> dict[str, SpilledPart]:
    """The manifest's page parts as parts on disk, read when used (each file opened once)."""
    out = {}
    for name, parts in _page_entries(manifest, src).items():
        try:
            file = PageFile.existing(src / name)
        except OSError as e:
            raise _os_error(e, str(src / name)) from None
        for key, (off, dtype, shape, sha) in parts.items():
            d = getattr(mx, dtype)
            out[key] = SpilledPart(Extent(file, off, (("", key, d, shape),), _part_bytes(dtype, shape), (sha,)), 0)
    return out


@dataclass
class Header:
    """An arrays file's safetensors header: every array's dtype and shape (the page
    parts a snapshot links too), and the metadata."""

    shapes: Shapes
    metadata: dict[str, str]
    pages: dict[str, tuple[str, int]] = field(default_factory=dict)  # page part -> (page file, offset)


def read_header(src: Path, manifest: dict, verify: bool = False) -> Header:
    """The header of the arrays file `manifest` names, checked without reading the
    arrays: the file is regular and of the size the manifest says (with `verify`, of
    its sha256 too), and every array lies inside it with none overlapping, so loading
    it allocates at most its size. Raises SnapshotError."""
    data, size, sha = _arrays_file(manifest, src)
    fd = _open_file_of(src, data)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise SnapshotError(f"{src}: {data.name} is truncated or padded ({actual} bytes, the manifest says {size})")
        if verify and _sha256_fd(fd, size, str(data)) != sha:
            raise SnapshotError(f"{src}: {data.name} is corrupted (checksum mismatch)")
        if size < 8:
            raise SnapshotError(f"{src}: {data.name} is too short for a safetensors file")
        n = int.from_bytes(_read_at(fd, 8, 0, str(data)), "little")
        if n > min(size - 8, MAX_JSON):
            raise SnapshotError(f"{src}: {data.name} has a header of {n} bytes in a file of {size}")
        header = parse_json(_read_at(fd, n, 8, str(data)), f"{src}: damaged {data.name} header")
    finally:
        os.close(fd)
    try:
        checked = _check_header(header, size - 8 - n)
    except ValueError as e:
        raise SnapshotError(f"{src}: damaged {data.name} header: {e}") from None
    _check_pages(src, manifest, checked, verify)
    return checked


def _check_header(header, room: int) -> Header:
    if not isinstance(header, dict):
        raise ValueError("not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("the metadata must map names to text")
    shapes, spans = {}, []
    for name, info in header.items():
        if len(name) > 512 or not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"entry {name[:60]!r} is malformed")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"{name[:60]!r}: unknown dtype {str(dtype)[:20]!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape)):
            raise ValueError(f"{name[:60]!r}: malformed shape")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= room):
            raise ValueError(f"{name[:60]!r}: its data lies outside the file")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype][1]:
            raise ValueError(f"{name[:60]!r}: {offsets[1] - offsets[0]} bytes for a {DTYPES[dtype][0]} "
                             f"array of shape {shape}")
        shapes[name] = (DTYPES[dtype][0], tuple(shape))
        spans.append(tuple(offsets))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError("arrays overlap")
    return Header(shapes, metadata)


def shapes_of(arrays: dict) -> Shapes:
    """Every array's dtype and shape, as a header states them."""
    return {k: (str(v.dtype).rpartition(".")[2], tuple(v.shape)) for k, v in arrays.items()}


def verify_snapshot(src: Path, check: Callable[[dict, Shapes], None] | None = None) -> tuple[dict, Header]:
    """The manifest and arrays header of the snapshot at `src`, checked as
    load_snapshot checks them (checksums included), without reading any array."""
    stamp = stamp_of(src)
    manifest = read_manifest(src)
    try:
        header = read_header(src, manifest, verify=True)
        if header.metadata.get("manifest_sha256") != manifest_digest(manifest):
            raise SnapshotError(f"{src}: the manifest does not match its arrays (edited or mixed up)")
        if check is not None:
            check(manifest, header.shapes)
    except SnapshotError as e:
        e.stamp = e.stamp or stamp
        raise
    return manifest, header


def load_snapshot(path: str | os.PathLike,
                  check: Callable[[dict, Shapes], None] | None = None) -> tuple[dict[str, mx.array], dict]:
    """The arrays and manifest of the snapshot at `path`, checked: format, version,
    checksums, the arrays file's header, and (given `check`, called with the manifest
    and the header's shapes before any array is read) what the caller requires of it.
    Raises SnapshotError saying what is wrong."""
    src = Path(path).expanduser()
    stamp = stamp_of(src)
    manifest, header = verify_snapshot(src, check)
    try:
        data = _arrays_file(manifest, src)[0]
        try:
            arrays, metadata = mx.load(str(data), return_metadata=True)
        except (ValueError, RuntimeError, OSError) as e:
            raise SnapshotError(f"{src}: unreadable arrays ({str(e)[:200]})") from None
        own = {k: v for k, v in header.shapes.items() if k not in header.pages}
        if metadata.get("manifest_sha256") != header.metadata.get("manifest_sha256") or shapes_of(arrays) != own:
            raise SnapshotError(f"{src}: {data.name} changed while it was read", damaged=False)
        arrays.update(_page_parts(src, manifest))
    except SnapshotError as e:
        e.stamp = e.stamp or stamp
        raise
    return arrays, manifest

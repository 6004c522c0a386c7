"""The on-disk snapshot: a safetensors file of arrays and a JSON manifest that names
the format version, what the state belongs to, and the size and sha256 of the arrays
(mandatory); the arrays carry the hash of the rest of the manifest, so neither can be
edited or swapped alone.

KV pages already on disk (kvexec.disk_pages) are not written again: their page file is
hard-linked into the snapshot (`pages-*.bin`, made durable first) and the manifest names
each part's place there and its sha256, taken when the page was written; where a link
cannot be made (another file system) the parts are copied into the arrays file.

Publishing is atomic: a new snapshot is written into a temporary beside its
destination, fsynced (files, then the directory), and renamed into place in one
step; an existing snapshot is replaced by swapping its manifest (the pointer to its
arrays file) in one rename. A crash or a full disk mid-write leaves the previous
snapshot whole, and the temporary names its owner for later cleanup.

Reading trusts nothing a file says before checking it: a manifest is read only up to
`MAX_JSON` bytes, its nesting checked against `MAX_DEPTH` before it is parsed, numbers
bounded (no NaN or Infinity, no thousand-digit integers) and every field the format
defines checked for type and range; the arrays file's safetensors header is read on
its own and every array checked to lie inside the file, none overlapping, so loading
allocates at most the file's size. Every failure is a SnapshotError, which says
whether the snapshot is damaged (to quarantine) or only could not be read now.
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

from statetrans.disk import fsync_path, remove, temp_mine, temp_name, temp_owner
from statetrans.bounded_json import bounded_loads
from statetrans.faults import NONE, Faults

FORMAT = "justfit-state"
VERSION = 1
ARRAYS = "arrays.safetensors"
MANIFEST = "manifest.json"
_ARRAYS_NAME = re.compile(r"^arrays(?:-[0-9a-f]{8,64})?\.safetensors$")
_PAGES_NAME = re.compile(r"^pages-[0-9a-f]{8,64}\.bin$")
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


def _sha256(path: Path) -> str:
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


def _digest(manifest: dict) -> str:
    """Hash of everything the manifest says except the file checksums; kept inside the
    arrays file, so an edited manifest (other tokens, other layers) is caught."""
    core = {k: v for k, v in manifest.items() if k != "files"}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_files(folder: Path, arrays: dict[str, mx.array], meta: dict, arrays_name: str = ARRAYS,
                manifest_name: str = MANIFEST, faults: Faults = NONE) -> None:
    """Write the arrays file and the manifest into `folder` and fsync both."""
    manifest = {"format": FORMAT, "version": VERSION, **json.loads(json.dumps(meta))}
    pages, arrays = _link_pages(folder, arrays)
    if pages:
        manifest["pages"] = pages
    data = folder / arrays_name
    if all(isinstance(a, mx.array) for a in arrays.values()):
        mx.save_safetensors(str(data), arrays, metadata={"manifest_sha256": _digest(manifest)})
    else:  # KV pages on disk among them: streamed, never all in memory at once
        _save_streamed(data, arrays, {"manifest_sha256": _digest(manifest)})
    faults.reach("write")
    manifest["files"] = {arrays_name: {"sha256": _sha256(data), "bytes": data.stat().st_size}}
    (folder / manifest_name).write_text(json.dumps(manifest, separators=(",", ":")))
    fsync_path(data)
    fsync_path(folder / manifest_name)
    faults.reach("fsync")


_CODES = {name: code for code, (name, _) in DTYPES.items()}
_PIECE = 8 << 20  # bytes of a page part read and written at a time


def _code(dtype) -> str:
    return _CODES[str(dtype).rpartition(".")[2]]


def _link_pages(folder: Path, arrays: dict) -> tuple[dict, dict]:
    """Link the page files behind `arrays`' parts on disk into `folder`: the manifest's
    "pages" entry (file -> array name -> offset, dtype, shape, sha256) and the arrays
    left to write (the rest, and parts whose file could not be linked)."""
    pages: dict[str, dict] = {}
    rest: dict = {}
    names: dict[int, str | None] = {}
    for key, a in arrays.items():
        file = getattr(getattr(a, "extent", None), "file", None)
        if file is None or getattr(file, "path", None) is None or a.sha256 is None:
            rest[key] = a
            continue
        if id(file) not in names:
            names[id(file)] = None
            try:
                file.sync()  # durable before a manifest names it
                name = f"pages-{os.urandom(8).hex()}.bin"
                os.link(file.path, folder / name)
                names[id(file)] = name
            except OSError:  # another file system, the name gone: the parts are copied
                pass
        name = names[id(file)]
        if name is None:
            rest[key] = a
            continue
        pages.setdefault(name, {})[key] = {"offset": a.offset, "dtype": _code(a.dtype), "shape": list(a.shape),
                                           "sha256": a.sha256}
    return pages, rest


def _save_streamed(path: Path, arrays: dict, metadata: dict[str, str]) -> None:
    """A safetensors file of `arrays`, arrays or parts read as they are written (objects
    with dtype, shape, nbytes and read_into(buffer, offset): kvexec.disk_pages.SpilledPart),
    through one reused buffer."""
    header, at = {"__metadata__": metadata}, 0
    for name, a in arrays.items():
        header[name] = {"dtype": _code(a.dtype), "shape": list(a.shape),
                        "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    buffer = memoryview(bytearray(_PIECE))
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for a in arrays.values():
            if isinstance(a, mx.array):
                flat = mx.contiguous(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
                mx.eval(flat)
                f.write(memoryview(flat).cast("B"))
                continue
            done = 0
            while done < a.nbytes:
                n = a.read_into(buffer, done)
                f.write(buffer[:n])
                done += n


def publish_new(dest: Path, arrays: dict[str, mx.array], meta: dict, faults: Faults = NONE) -> int:
    """Write a snapshot at `dest`, which must not exist: a temporary folder, fsynced,
    then one rename (and the parent fsynced). Returns the bytes written."""
    tmp = dest.with_name(temp_name(dest.name))
    tmp.mkdir(parents=True)
    try:
        write_files(tmp, arrays, meta, faults=faults)
        fsync_path(tmp)
        faults.reach("publish")
        os.rename(tmp, dest)
    except BaseException:
        remove(tmp)
        raise
    faults.reach("published")
    fsync_path(dest.parent)
    return snapshot_bytes(dest)


def save_snapshot(path: str | os.PathLike, arrays: dict[str, mx.array], meta: dict) -> int:
    """Write `arrays` and `meta` as a snapshot at `path`, replacing a snapshot there
    atomically (only once the new one is durable); returns the bytes written."""
    dest = Path(path).expanduser()
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        return publish_new(dest, arrays, meta)
    if not dest.is_dir() or any(p.name != MANIFEST and not _ARRAYS_NAME.match(p.name) and not _PAGES_NAME.match(p.name)
                                and temp_owner(p.name) is None for p in dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not a state snapshot; not replacing it")
    # Swap the pointer: a new arrays file under its own name, then the manifest naming
    # it renamed over the old one; the old arrays file goes once the swap is durable.
    name = f"arrays-{os.urandom(6).hex()}.safetensors"
    staged = temp_name("manifest")
    before = {p.name for p in dest.iterdir()}
    try:
        write_files(dest, arrays, meta, name, staged)
        os.rename(dest / staged, dest / MANIFEST)
        fsync_path(dest)
    except BaseException:
        remove(dest / staged)
        remove(dest / name)
        for p in dest.iterdir():  # page files linked for the new one
            if _PAGES_NAME.match(p.name) and p.name not in before:
                remove(p)
        raise
    kept = {name, *_page_names(read_json_file(dest / MANIFEST, str(dest / MANIFEST)))}
    for p in dest.iterdir():
        if p.name != MANIFEST and p.name not in kept and (_ARRAYS_NAME.match(p.name) or _PAGES_NAME.match(p.name)
                                                          or temp_mine(p.name)):
            remove(p)
    return snapshot_bytes(dest)


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
    if not isinstance(name, str) or not _ARRAYS_NAME.match(name):
        raise SnapshotError(f"{src}: the manifest names an unexpected file {name[:80]!r}")
    if (not isinstance(info, dict) or set(info) != {"sha256", "bytes"} or type(info["bytes"]) is not int
            or not 0 <= info["bytes"] < 2**63
            or not isinstance(info.get("sha256"), str) or not _HEX64.match(info["sha256"])):
        raise SnapshotError(f"{src}: the manifest's checksum entry for {name} is malformed")
    return src / name, info["bytes"], info["sha256"]


def _page_names(manifest) -> list[str]:
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
        if not _PAGES_NAME.match(name):
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
        if header.metadata.get("manifest_sha256") != _digest(manifest):
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

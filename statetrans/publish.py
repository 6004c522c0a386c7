"""Writing a snapshot (statetrans.snapshot is its format) and publishing it.

KV pages already on disk (kvexec.disk_pages) are not written again: their page file is
hard-linked into the snapshot (`pages-*.bin`, made durable first) and the manifest names
each part's place there and its sha256, taken when the page was written; where a link
cannot be made (another file system) the parts are copied into the arrays file.

Publishing is atomic: a new snapshot is written into a temporary beside its
destination, fsynced (files, then the directory), and renamed into place in one
step; an existing snapshot is replaced by swapping its manifest (the pointer to its
arrays file) in one rename. A crash or a full disk mid-write leaves the previous
snapshot whole, and the temporary names its owner for later cleanup.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from statetrans.disk import fsync_path, remove, temp_mine, temp_name, temp_owner
from statetrans.faults import NONE, Faults
from statetrans.snapshot import (ARRAYS, ARRAYS_NAME, DTYPES, FORMAT, MANIFEST, PAGES_NAME, VERSION, file_sha256,
                                 manifest_digest, page_names, read_json_file, snapshot_bytes)


def write_files(folder: Path, arrays: dict[str, mx.array], meta: dict, arrays_name: str = ARRAYS,
                manifest_name: str = MANIFEST, faults: Faults = NONE) -> None:
    """Write the arrays file and the manifest into `folder` and fsync both."""
    manifest = {"format": FORMAT, "version": VERSION, **json.loads(json.dumps(meta))}
    pages, arrays = _link_pages(folder, arrays)
    if pages:
        manifest["pages"] = pages
    data = folder / arrays_name
    if all(isinstance(a, mx.array) for a in arrays.values()):
        mx.save_safetensors(str(data), arrays, metadata={"manifest_sha256": manifest_digest(manifest)})
    else:  # KV pages on disk among them: streamed, never all in memory at once
        _save_streamed(data, arrays, {"manifest_sha256": manifest_digest(manifest)})
    faults.reach("write")
    manifest["files"] = {arrays_name: {"sha256": file_sha256(data), "bytes": data.stat().st_size}}
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
    if not dest.is_dir() or any(p.name != MANIFEST and not ARRAYS_NAME.match(p.name) and not PAGES_NAME.match(p.name)
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
            if PAGES_NAME.match(p.name) and p.name not in before:
                remove(p)
        raise
    kept = {name, *page_names(read_json_file(dest / MANIFEST, str(dest / MANIFEST)))}
    for p in dest.iterdir():
        if p.name != MANIFEST and p.name not in kept and (ARRAYS_NAME.match(p.name) or PAGES_NAME.match(p.name)
                                                          or temp_mine(p.name)):
            remove(p)
    return snapshot_bytes(dest)

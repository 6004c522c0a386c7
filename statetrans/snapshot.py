"""The on-disk snapshot: a safetensors file of arrays and a JSON manifest that names
the format version, what the state belongs to, and the size and sha256 of the arrays
(mandatory); the arrays carry the hash of the rest of the manifest, so neither can be
edited or swapped alone.

Publishing is atomic: a new snapshot is written into a temporary beside its
destination, fsynced (files, then the directory), and renamed into place in one
step; an existing snapshot is replaced by swapping its manifest (the pointer to its
arrays file) in one rename. A crash or a full disk mid-write leaves the previous
snapshot whole, and the temporary names its owner's PID for later cleanup.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import mlx.core as mx

from statetrans.disk import fsync_path, remove, temp_name, temp_owner
from statetrans.faults import NONE, Faults

FORMAT = "justfit-state"
VERSION = 1
ARRAYS = "arrays.safetensors"
MANIFEST = "manifest.json"
_ARRAYS_NAME = re.compile(r"^arrays(?:-[0-9a-f]{8,64})?\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded: missing, damaged, or for something else."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
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
    data = folder / arrays_name
    mx.save_safetensors(str(data), arrays, metadata={"manifest_sha256": _digest(manifest)})
    faults.reach("write")
    manifest["files"] = {arrays_name: {"sha256": _sha256(data), "bytes": data.stat().st_size}}
    (folder / manifest_name).write_text(json.dumps(manifest, separators=(",", ":")))
    fsync_path(data)
    fsync_path(folder / manifest_name)
    faults.reach("fsync")


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
    if not dest.is_dir() or any(p.name != MANIFEST and not _ARRAYS_NAME.match(p.name) and temp_owner(p.name) is None
                                for p in dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not a state snapshot; not replacing it")
    # Swap the pointer: a new arrays file under its own name, then the manifest naming
    # it renamed over the old one; the old arrays file goes once the swap is durable.
    name = f"arrays-{os.urandom(6).hex()}.safetensors"
    staged = temp_name("manifest")
    try:
        write_files(dest, arrays, meta, name, staged)
        os.rename(dest / staged, dest / MANIFEST)
        fsync_path(dest)
    except BaseException:
        remove(dest / staged)
        remove(dest / name)
        raise
    for p in dest.iterdir():
        if p.name not in (MANIFEST, name) and (_ARRAYS_NAME.match(p.name) or temp_owner(p.name) == os.getpid()):
            remove(p)
    return snapshot_bytes(dest)


def snapshot_bytes(path: str | os.PathLike) -> int:
    """Bytes the snapshot at `path` takes on disk."""
    return sum(f.stat().st_size for f in Path(path).expanduser().iterdir() if f.is_file())


def read_manifest(src: Path) -> dict:
    """The manifest of the snapshot at `src`, parsed and checked for form, not
    checksums (cheap: for indexing). Raises SnapshotError."""
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {src} (missing {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{src}: damaged manifest ({e})") from None
    except OSError as e:
        raise SnapshotError(f"{src}: unreadable manifest ({e.strerror or e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{src}: not a JustFit state snapshot")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"{src}: snapshot format version {manifest.get('version')!r}, this JustFit reads {VERSION}")
    _arrays_file(manifest, src)
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
        raise SnapshotError(f"{src}: the manifest names an unexpected file {name!r}")
    if (not isinstance(info, dict) or set(info) != {"sha256", "bytes"} or type(info["bytes"]) is not int
            or info["bytes"] < 0
            or not isinstance(info.get("sha256"), str) or not _HEX64.match(info["sha256"])):
        raise SnapshotError(f"{src}: the manifest's checksum entry for {name} is malformed")
    return src / name, info["bytes"], info["sha256"]


def load_snapshot(path: str | os.PathLike) -> tuple[dict[str, mx.array], dict]:
    """The arrays and manifest of the snapshot at `path`, checked: format, version and
    checksums; raises SnapshotError saying what is wrong."""
    src = Path(path).expanduser()
    manifest = read_manifest(src)
    data, size, sha = _arrays_file(manifest, src)
    try:
        if not data.is_file():
            raise SnapshotError(f"{src}: missing {data.name}")
        if data.stat().st_size != size:
            raise SnapshotError(f"{src}: {data.name} is truncated or padded ({data.stat().st_size} bytes, "
                                f"the manifest says {size})")
        if _sha256(data) != sha:
            raise SnapshotError(f"{src}: {data.name} is corrupted (checksum mismatch)")
    except OSError as e:  # e.g. deleted meanwhile by its owner
        raise SnapshotError(f"{src}: cannot read {data.name} ({e.strerror or e})") from None
    try:
        arrays, stamp = mx.load(str(data), return_metadata=True)
    except (ValueError, RuntimeError, OSError) as e:
        raise SnapshotError(f"{src}: unreadable arrays ({e})") from None
    if stamp.get("manifest_sha256") != _digest(manifest):
        raise SnapshotError(f"{src}: the manifest does not match its arrays (edited or mixed up)")
    return arrays, manifest

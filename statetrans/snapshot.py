"""The on-disk snapshot: one safetensors file of arrays and a JSON manifest that
names the format version, what the state belongs to, and the sha256 of the arrays.

A snapshot is a directory written beside its destination and renamed into place
after fsync, so a crash or a full disk mid-write leaves the previous snapshot whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx

FORMAT = "justfit-state"
VERSION = 1
ARRAYS = "arrays.safetensors"
MANIFEST = "manifest.json"


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_snapshot(path: str | os.PathLike, arrays: dict[str, mx.array], meta: dict) -> int:
    """Write `arrays` and `meta` as a snapshot at `path` (replacing one there only
    once the new one is complete); returns the bytes written."""
    dest = Path(path).expanduser()
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = {"format": FORMAT, "version": VERSION, **json.loads(json.dumps(meta))}
        mx.save_safetensors(str(tmp / ARRAYS), arrays, metadata={"manifest_sha256": _digest(manifest)})
        manifest["files"] = {ARRAYS: {"sha256": _sha256(tmp / ARRAYS), "bytes": (tmp / ARRAYS).stat().st_size}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, separators=(",", ":")))
        for f in (tmp / ARRAYS, tmp / MANIFEST, tmp):
            _fsync(f)
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
        _fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return snapshot_bytes(dest)


def snapshot_bytes(path: str | os.PathLike) -> int:
    """Bytes the snapshot at `path` takes on disk."""
    return sum(f.stat().st_size for f in Path(path).expanduser().iterdir())


def load_snapshot(path: str | os.PathLike) -> tuple[dict[str, mx.array], dict]:
    """The arrays and manifest of the snapshot at `path`, checked: format, version and
    checksums; raises SnapshotError saying what is wrong."""
    src = Path(path).expanduser()
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {src} (missing {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{src}: damaged manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise SnapshotError(f"{src}: not a JustFit state snapshot")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"{src}: snapshot format version {manifest.get('version')}, this JustFit reads {VERSION}")
    for name, info in manifest.get("files", {}).items():
        f = src / name
        if not f.is_file():
            raise SnapshotError(f"{src}: missing {name}")
        if f.stat().st_size != info["bytes"] or _sha256(f) != info["sha256"]:
            raise SnapshotError(f"{src}: {name} is truncated or corrupted (checksum mismatch)")
    try:
        arrays, stamp = mx.load(str(src / ARRAYS), return_metadata=True)
    except (ValueError, RuntimeError) as e:
        raise SnapshotError(f"{src}: unreadable arrays ({e})") from None
    if stamp.get("manifest_sha256") != _digest(manifest):
        raise SnapshotError(f"{src}: the manifest does not match its arrays (edited or mixed up)")
    return arrays, manifest

"""What a stored state belongs to, and the check that refuses a foreign one. The
model is identified by the content of its weight files (sha256), cached by path,
size and mtime in a small JSON file so only the first load of a model pays for it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from statetrans.disk import claim, locked, remove, temp_name
from statetrans.schema import Expect, check_state
from statetrans.snapshot import SnapshotError, load_snapshot, read_header, read_json_file, read_manifest, stamp_of
from statetrans.state import holds, rebuild, state_bytes

DIGESTS = "weights-sha256.json"


def identity_key(identity: dict) -> str:
    """The folder name of one identity's disk tier."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def check_identity(manifest: dict, identity: dict, where: str) -> None:
    """Refuse a snapshot computed by another model or with other KV settings."""
    if manifest.get("model") != identity.get("model"):
        raise SnapshotError(f"{where}: saved with model {manifest.get('model_name')!r} "
                            f"({manifest.get('model')}), not this engine's {identity.get('model_name')!r} "
                            f"(other weights)")
    kv = [(m if isinstance(m, dict) else {}).get("format", "mlx-lm") for m in (manifest.get("kv"), identity.get("kv"))]
    if manifest.get("kv") != identity.get("kv"):
        raise SnapshotError(f"{where}: saved with KV format {kv[0]} (or other KV settings), this engine uses {kv[1]}")
    if manifest.get("policy") != identity.get("policy"):
        raise SnapshotError(f"{where}: saved under PhaseSwap policy {manifest.get('policy')!r}, this engine "
                            f"runs {identity.get('policy')!r} (other weight forms compute other states)")


def read_checked(path: str | Path, identity: dict, layers: int, vocab: int | None = None) -> tuple[list, dict, int]:
    """A snapshot's cache, manifest and in-memory bytes, checked against `identity`
    (model, KV settings, weight forms), the model's layer count and vocabulary, and
    (statetrans.schema) before any array is read, what its header says the arrays are;
    raises SnapshotError otherwise, whatever went wrong reading it."""
    where = str(path)

    def check(manifest: dict, shapes: dict) -> None:
        check_identity(manifest, identity, where)
        check_state(manifest, shapes, Expect(layers, vocab), where)

    try:
        arrays, manifest = load_snapshot(path, check)
        cache = rebuild(arrays, manifest["layers"])
    except SnapshotError:
        raise
    except Exception as err:  # noqa: BLE001 - a stored file's content must never crash its reader
        raise SnapshotError(f"{path}: inconsistent snapshot ({type(err).__name__}: {str(err)[:200]})",
                            damaged=not isinstance(err, MemoryError)) from err  # too large now is not damage
    tokens = manifest["tokens"]
    if len(cache) != layers or not holds(cache, len(tokens)):
        raise SnapshotError(f"{path}: state does not match its tokens or this model's layers")
    return cache, manifest, state_bytes(arrays)


def peek(path: Path, identity: dict, expect: Expect) -> dict:
    """A snapshot's manifest, checked as read_checked does but without reading its
    arrays (their header only; the checksum is checked on use): what a scan indexes.
    Raises SnapshotError."""
    stamp = stamp_of(path)
    manifest = read_manifest(path)
    try:
        check_identity(manifest, identity, str(path))
        check_state(manifest, read_header(path, manifest).shapes, expect, str(path))
    except SnapshotError as e:
        e.stamp = e.stamp or stamp
        raise
    return manifest


def file_sha256(path: Path, cache_dir: Path | None) -> str:
    """sha256 of a file's content; with `cache_dir`, remembered there by (resolved
    path, size, mtime), so an unchanged file is hashed once per machine."""
    st = path.stat()
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns]
    cache = _read_cache(cache_dir)
    hit = cache.get(key)
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    if cache_dir is not None:
        try:
            claim(cache_dir)  # its temporary below is a live owner's to other processes
        except OSError:
            pass  # then they judge it by PID and start time
        with locked(cache_dir):  # other processes may be adding theirs
            cache = _read_cache(cache_dir)
            cache[key] = {"stamp": stamp, "sha256": digest}
            tmp = cache_dir / temp_name(DIGESTS)
            try:
                tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
                os.replace(tmp, cache_dir / DIGESTS)
            except OSError:  # a cache: failing to write it only costs a rehash later
                remove(tmp)
    return digest


def _read_cache(cache_dir: Path | None) -> dict:
    if cache_dir is None:
        return {}
    try:
        data = read_json_file(cache_dir / DIGESTS, str(cache_dir / DIGESTS))
    except (OSError, SnapshotError):  # a cache: unreadable is empty
        return {}
    return data if isinstance(data, dict) else {}


def weights_digest(files: list[Path], cache_dir: Path | None) -> str:
    """One hash over the names and contents of a model's weight files."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{file_sha256(f, cache_dir)}\n".encode())
    return h.hexdigest()

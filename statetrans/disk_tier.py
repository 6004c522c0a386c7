"""The disk tier of anonymous states (prefix-cache entries): one snapshot per state
under `anon/`, written when memory is short, found again by later processes, and
deleted when the tier is full: only states this process wrote, or whose writer is
dead, never another live process's."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import mlx.core as mx

from statetrans.disk import discard, fsync_path, locked, mine, owner_alive, owner_tag
from statetrans.faults import NONE, Faults
from statetrans.identity import check_identity
from statetrans.memory_tier import Entry
from statetrans.snapshot import SnapshotError, publish_new, read_manifest, snapshot_bytes
from statetrans.state import trimmable_meta

ANON = "anon"


class DiskTier:
    """One model's anonymous states on disk: written, scanned and deleted here."""

    def __init__(self, root: Path, identity: dict, faults: Faults = NONE):
        self.root, self.identity, self.faults = root, identity, faults
        self.dir = root / ANON

    def write(self, e: Entry, arrays: dict[str, mx.array], layers: list[dict]) -> tuple[Path, int, dict]:
        """Publish an anonymous state; returns (path, bytes, owner). Raises on failure
        with nothing published."""
        self.faults.reach("spill")
        self.dir.mkdir(parents=True, exist_ok=True)
        owner = owner_tag()
        meta = {**self.identity, "tokens": list(e.tokens), "layers": layers, "session": None,
                "sampler": e.sampler, "owner": owner}
        path = self.dir / f"{e.key}-{uuid.uuid4().hex[:8]}"  # unique across processes
        return path, publish_new(path, arrays, meta, self.faults), owner

    def may_delete(self, e: Entry) -> bool:
        """Whether this process may delete `e`'s disk copy: its own, or a dead one's."""
        return e.path is not None and (mine(e.owner) or not owner_alive(e.owner))

    def delete(self, e: Entry) -> None:
        """Delete `e`'s disk copy if this process may (under the directory lock)."""
        if not self.may_delete(e):
            return
        with locked(self.root):
            discard(e.path)
        fsync_path(self.dir)

    def scan(self) -> list[Entry]:
        """Anonymous states on disk for this identity (manifests only; checked on use)."""
        if not self.dir.is_dir():
            return []
        found = []
        for d in self.dir.iterdir():
            if d.name.startswith("."):
                continue
            try:
                m = read_manifest(d)
                check_identity(m, self.identity, str(d))
                e = Entry(d.name, [int(t) for t in m["tokens"]], path=d, disk_bytes=snapshot_bytes(d),
                          sampler=m.get("sampler") or {}, owner=m.get("owner"),
                          trimmable=all(trimmable_meta(layer) for layer in m.get("layers", [])))
                found.append((d.stat().st_mtime, e))
            except (OSError, ValueError, TypeError, KeyError, AttributeError, SnapshotError):
                continue
        return [e for _, e in sorted(found, key=lambda f: f[0])]


def describe(path: Path) -> dict:
    """What `state ls` shows of a snapshot (manifest only)."""
    m = read_manifest(path)
    kv = m.get("kv") if isinstance(m.get("kv"), dict) else {}
    return {"tokens": len(m.get("tokens") or []), "bytes": snapshot_bytes(path), "format": kv.get("format", "mlx-lm"),
            "model": m.get("model_name"), "mtime": path.stat().st_mtime,
            "owner": json.loads(json.dumps(m.get("owner")))}

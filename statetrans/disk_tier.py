"""The disk tier of anonymous states (prefix-cache entries): one snapshot per state
under `anon/`, written when memory is short, found again by later processes, and
deleted when the tier is full: only states this process wrote, or whose writer is
dead, never another live process's. A state that fails its checks at the scan is
quarantined (statetrans.quarantine), never indexed."""

from __future__ import annotations

import json
import logging
import stat
import uuid
from pathlib import Path

import mlx.core as mx

from statetrans.disk import claim, discard, fsync_path, locked, mine, owner_alive, owner_tag, owners_of
from statetrans.faults import NONE, Faults
from statetrans.identity import peek
from statetrans.index import Entry
from statetrans.quarantine import quarantine, scannable
from statetrans.schema import Expect
from statetrans.publish import publish_new
from statetrans.snapshot import SnapshotError, read_manifest, snapshot_bytes
from statetrans.state import trimmable_meta

log = logging.getLogger("justfit.statetrans")

ANON = "anon"


class DiskTier:
    """One model's anonymous states on disk: written, scanned and deleted here."""

    def __init__(self, root: Path, identity: dict, faults: Faults = NONE, expect: Expect = Expect(),
                 quarantine_limit: int | None = None):
        self.root, self.identity, self.faults, self.expect = root, identity, faults, expect
        self.quarantine_limit = quarantine_limit  # what fails its checks goes there (None: no limit)
        self.dir = root / ANON

    def write(self, e: Entry, arrays: dict[str, mx.array], layers: list[dict]) -> tuple[Path, int, dict]:
        """Publish an anonymous state; returns (path, bytes, owner). Raises on failure
        with nothing published."""
        self.faults.reach("spill")
        self.dir.mkdir(parents=True, exist_ok=True)
        claim(self.root.parent)  # its temporary and its owner tag are a live owner's to other processes
        owner = owner_tag()
        meta = {**self.identity, "tokens": list(e.tokens), "layers": layers, "session": None,
                "sampler": e.sampler, "owner": owner, "scope": e.scope}
        path = self.dir / f"{e.key}-{uuid.uuid4().hex[:8]}"  # unique across processes
        return path, publish_new(path, arrays, meta, self.faults), owner

    def may_delete(self, e: Entry) -> bool:
        """Whether this process may delete `e`'s disk copy: its own, or a dead one's."""
        return e.path is not None and (mine(e.owner) or not owner_alive(e.owner, owners_of(self.root)))

    def delete(self, e: Entry) -> None:
        """Delete `e`'s disk copy if this process may (under the directory lock)."""
        if not self.may_delete(e):
            return
        with locked(self.root):
            discard(e.path)
        fsync_path(self.dir)

    def scan(self) -> list[Entry]:
        """Anonymous states on disk for this identity (manifests and headers only; the
        checksums are checked on use); what fails its checks is quarantined."""
        if not scannable(self.root, self.dir, self.quarantine_limit):
            return []
        found = []
        for d in _listing(self.dir):
            if d.name.startswith("."):
                continue  # temporaries (a live writer's stay untouched) and the like
            try:
                e, mtime = self._entry(d)
            except SnapshotError as err:
                quarantine(self.root, d, err, self.quarantine_limit)
                continue
            found.append((mtime, e))
        return [e for _, e in sorted(found, key=lambda f: f[0])]

    def _entry(self, d: Path) -> tuple[Entry, float]:
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode):
                raise SnapshotError(f"{d}: not a snapshot folder")
            m = peek(d, self.identity, self.expect)
            if m.get("session") is not None:
                raise SnapshotError(f"{d}: a session's state among the anonymous ones")
            return Entry(d.name, list(m["tokens"]), path=d, disk_bytes=snapshot_bytes(d),
                         sampler=dict(m.get("sampler") or {}), owner=m.get("owner"), scope=m.get("scope") or "",
                         trimmable=all(trimmable_meta(layer) for layer in m["layers"])), st.st_mtime
        except OSError as err:  # vanished or unreadable meanwhile: skipped, not damaged
            raise SnapshotError(f"{d}: cannot read it ({err.strerror or err})", damaged=False) from None


def _listing(folder: Path) -> list[Path]:
    """What `folder` holds; [] when it is missing or cannot be listed (logged)."""
    try:
        return list(folder.iterdir())
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("cannot list the stored states in %s: %s", folder, err)
        return []


def describe(path: Path) -> dict:
    """What `state ls` shows of a snapshot (manifest only)."""
    m = read_manifest(path)
    kv = m.get("kv") if isinstance(m.get("kv"), dict) else {}
    return {"tokens": len(m.get("tokens") or []), "bytes": snapshot_bytes(path), "format": kv.get("format", "mlx-lm"),
            "model": m.get("model_name"), "mtime": path.stat().st_mtime,
            "owner": json.loads(json.dumps(m.get("owner")))}

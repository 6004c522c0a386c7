"""Named sessions on disk: user data, kept until dropped. Each session is a folder
(named by the hash of its name: a client's name never becomes a path) of numbered
generations `g000000000001`, ...; each turn publishes the next one atomically, the
newest complete generation wins on read, and older ones are removed only once the
newer one is durable. A session folder is deleted only by an explicit drop."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import mlx.core as mx

from statetrans.disk import discard, fsync_path, locked, remove, temp_name
from statetrans.faults import NONE, Faults
from statetrans.identity import check_identity
from statetrans.memory_tier import Entry
from statetrans.snapshot import SnapshotError, read_manifest, snapshot_bytes, write_files
from statetrans.state import trimmable_meta

SESSIONS = "sessions"
EXTRA = "extra.json"
_GEN = re.compile(r"^g(\d{12})$")


def folder_name(name: str) -> str:
    """A session's folder: a hash of its name, so any name is safe on disk."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class SessionStore:
    """One model's named sessions on disk, each a folder of atomically published generations."""

    def __init__(self, root: Path, identity: dict, faults: Faults = NONE):
        self.root, self.identity, self.faults = root, identity, faults
        self.dir = root / SESSIONS

    def folder(self, name: str) -> Path:
        """Session `name`'s folder, whether or not it exists."""
        return self.dir / folder_name(name)

    def generations(self, name: str) -> list[tuple[int, Path]]:
        """(generation, path) of a session's published generations, newest first."""
        return generations_in(self.folder(name))

    def publish(self, name: str, arrays: dict[str, mx.array], meta: dict, generation: int) -> tuple[int, Path, int]:
        """Write the next generation of session `name` (at least `generation`, past any
        on disk): temporary, fsync, one rename under the lock, fsync, then remove the
        older generations. Returns (generation, path, bytes)."""
        folder = self.folder(name)
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            fsync_path(folder.parent)
        tmp = folder / temp_name("g")
        tmp.mkdir()
        try:
            write_files(tmp, arrays, {**meta, "session": name}, faults=self.faults)
            fsync_path(tmp)
            with locked(self.root):
                older = self.generations(name)
                generation = max(generation, older[0][0] + 1 if older else 1)
                path = folder / f"g{generation:012d}"
                self.faults.reach("publish")
                os.rename(tmp, path)
                self.faults.reach("published")
                fsync_path(folder)  # the new generation is durable: the older ones may go
                for _, old in older:
                    self.faults.reach("cleanup")
                    discard(old)
        except BaseException:
            remove(tmp)
            raise
        return generation, path, snapshot_bytes(path)

    def write_extra(self, name: str, extra: dict) -> None:
        """Keep `extra` (JSON: e.g. a chat's transcript) beside session `name`,
        replaced atomically; it goes when the session is dropped."""
        folder = self.folder(name)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / temp_name(EXTRA)
        try:
            tmp.write_text(json.dumps({"session": name, "extra": extra}))
            fsync_path(tmp)
            os.rename(tmp, folder / EXTRA)
        except BaseException:
            remove(tmp)
            raise
        fsync_path(folder)

    def read_extra(self, name: str) -> dict:
        """What `write_extra` kept for session `name` ({} if nothing readable)."""
        try:
            data = json.loads((self.folder(name) / EXTRA).read_text())
        except (OSError, ValueError):
            return {}
        ok = isinstance(data, dict) and data.get("session") == name and isinstance(data.get("extra"), dict)
        return data["extra"] if ok else {}

    def drop(self, name: str) -> bool:
        """Delete session `name` from disk; whether there was one."""
        folder = self.folder(name)
        with locked(self.root):
            if not folder.exists():
                return False
            discard(folder)
        fsync_path(self.dir)
        return True

    def find(self, name: str, below: int | None = None) -> Entry | None:
        """Session `name`'s newest complete generation (below `below`, if given)."""
        for generation, path in self.generations(name):
            if below is not None and generation >= below:
                continue
            e = self._entry(path, generation)
            if e is not None and e.session == name:
                return e
        return None

    def scan(self) -> list[Entry]:
        """Every session's newest complete generation (manifests only; checksums are
        checked on use, falling back to an older generation)."""
        if not self.dir.is_dir():
            return []
        found = []
        for folder in self.dir.iterdir():
            for generation, path in generations_in(folder):
                e = self._entry(path, generation)
                if e is not None and folder_name(e.session) == folder.name:
                    found.append((path.stat().st_mtime, e))
                    break
        return [e for _, e in sorted(found, key=lambda f: f[0])]

    def _entry(self, path: Path, generation: int) -> Entry | None:
        try:
            m = read_manifest(path)
            check_identity(m, self.identity, str(path))
            (name, info), = m["files"].items()
            if (path / name).stat().st_size != info["bytes"] or not isinstance(m.get("session"), str):
                return None
            return Entry(f"{folder_name(m['session'])[:12]}-g{generation}", [int(t) for t in m["tokens"]],
                         path=path, disk_bytes=snapshot_bytes(path), session=m["session"],
                         sampler=m.get("sampler") or {}, generation=generation,
                         trimmable=all(trimmable_meta(layer) for layer in m.get("layers", [])))
        except (OSError, ValueError, TypeError, KeyError, AttributeError, SnapshotError):
            return None


def generations_in(folder: Path) -> list[tuple[int, Path]]:
    """(generation, path) in a session folder, newest first."""
    if not folder.is_dir():
        return []
    gens = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _GEN.match(p.name))]
    return sorted(gens, reverse=True)

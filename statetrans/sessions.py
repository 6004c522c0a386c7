"""Named sessions on disk: user data, kept until dropped or evicted by the sessions'
disk quota (statetrans.quota). Each session is a folder (named by the hash of its
scope and name: a client's name never becomes a path) of numbered generations
`g000000000001`, ...; each turn publishes the next one atomically, the newest complete
generation wins on read, and older ones are removed only once the newer one is
durable.

A turn states the generation it started from (`base`): when the session has moved
on since (another process, or another request of this one, published a newer
generation), the turn is kept as a fork `NAME~2` (the next free `~k`) instead of
replacing it, decided under the directory lock, so no turn is silently lost."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from statetrans.disk import claim, discard, real_dir, fsync_path, locked, remove, temp_alive, temp_name
from statetrans.faults import NONE, Faults
from statetrans.identity import peek
from statetrans.index import Entry
from statetrans.quarantine import quarantine, scannable
from statetrans.schema import Expect
from statetrans.publish import write_files
from statetrans.snapshot import SnapshotError, read_json_file, read_manifest, snapshot_bytes
from statetrans.state import trimmable_meta

SESSIONS = "sessions"
EXTRA = "extra.json"
_GEN = re.compile(r"^g([0-9]{12})$")
_ATTEMPTS = 8  # publishing races another writer's fork at most this often before giving up


def folder_name(name: str, scope: str = "") -> str:
    """A session's folder: a hash of its scope and name, so any name is safe on disk
    and two scopes' sessions of one name never meet (the shared scope's is the hash
    of the name alone, as before scopes)."""
    key = name.encode("utf-8", "surrogatepass")
    if scope:
        s = scope.encode("utf-8", "surrogatepass")
        key = b"scope:%d:%s\0%s" % (len(s), s, key)
    return hashlib.sha256(key).hexdigest()[:32]


@dataclass
class Usage:
    """A session folder's bytes on disk and when it was last touched (its mtime)."""

    bytes: int
    touched: float


class Published(NamedTuple):
    """Where a session state was published: the name it went under (another than asked
    for when kept as a fork), its generation, path and bytes."""

    name: str
    generation: int
    path: Path
    bytes: int


class SessionStore:
    """One model's named sessions on disk, each a folder of atomically published generations."""

    def __init__(self, root: Path, identity: dict, faults: Faults = NONE, expect: Expect = Expect(),
                 quarantine_limit: int | None = None):
        self.root, self.identity, self.faults, self.expect = root, identity, faults, expect
        self.quarantine_limit = quarantine_limit  # what fails its checks goes there (None: no limit)
        self.dir = root / SESSIONS
        try:
            claim(root.parent)  # its temporaries are a live owner's to other processes
        except OSError:
            pass  # (a state directory it cannot write: then nothing is written either)

    def folder(self, name: str, scope: str = "") -> Path:
        """Session `name`'s folder in `scope`, whether or not it exists."""
        return self.dir / folder_name(name, scope)

    def generations(self, name: str, scope: str = "") -> list[tuple[int, Path]]:
        """(generation, path) of a session's published generations, newest first."""
        return generations_in(self.folder(name, scope))

    def newest(self, name: str, scope: str = "") -> int:
        """Session `name`'s newest published generation (0: none)."""
        gens = self.generations(name, scope)
        return gens[0][0] if gens else 0

    def publish(self, name: str, arrays: dict[str, mx.array], meta: dict, generation: int, scope: str = "",
                base: int | None = None, origin: str | None = None) -> Published:
        """Write the next generation of session `name` (at least `generation`, past any
        on disk): temporary, fsync, one rename under the lock, fsync, then remove the
        older generations. With `base` (the generation the turn started from; 0: none)
        a session that has a newer one is not replaced: the state goes to a new fork
        `ORIGIN~k` (`origin`: the name the client asked for, default `name`)."""
        target, check = name, base
        for _ in range(_ATTEMPTS):
            folder = self.folder(target, scope)
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                fsync_path(folder.parent)
            tmp = folder / temp_name("g")
            tmp.mkdir()
            try:
                write_files(tmp, arrays, {**meta, "session": target, "scope": scope}, faults=self.faults)
                fsync_path(tmp)
                with locked(self.root):
                    older = self.generations(target, scope)
                    if check is not None and older and older[0][0] > check:  # moved on since the turn began
                        remove(tmp)
                        target, check = self.fork_name(origin or name, scope), 0
                        continue
                    generation = max(generation if target == name else 1, older[0][0] + 1 if older else 1)
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
            return Published(target, generation, path, snapshot_bytes(path))
        raise OSError(f"session {name!r} kept moving on while its state was being written ({_ATTEMPTS} tries)")

    def fork_name(self, origin: str, scope: str = "", taken=()) -> str:
        """A fork's name for session `origin`: `ORIGIN~k`, the first k >= 2 free on
        disk and not in `taken` (names this process holds unwritten)."""
        k = 2
        while f"{origin}~{k}" in taken or self.folder(f"{origin}~{k}", scope).exists():
            k += 1
        return f"{origin}~{k}"

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
            data = read_json_file(self.folder(name) / EXTRA, str(self.folder(name) / EXTRA))
        except (OSError, SnapshotError):
            return {}
        ok = isinstance(data, dict) and data.get("session") == name and isinstance(data.get("extra"), dict)
        return data["extra"] if ok else {}

    def drop(self, name: str, scope: str = "") -> bool:
        """Delete session `name` of `scope` from disk; whether there was one."""
        folder = self.folder(name, scope)
        with locked(self.root):
            if not folder.exists():
                return False
            discard(folder)
        fsync_path(self.dir)
        return True

    def drop_folder(self, folder: str) -> bool:
        """Delete a session by its folder's name (the quota's eviction: it knows no
        names); not while a live process writes into it. Whether it was deleted."""
        path = self.dir / folder
        with locked(self.root):
            try:
                busy = any(temp_alive(p) for p in path.iterdir())
            except OSError:
                return False
            if busy:
                return False
            discard(path)
        fsync_path(self.dir)
        return True

    def touch(self, name: str, scope: str = "") -> Usage | None:
        """Mark session `name` as used now (its folder's mtime: what the quota orders
        by, across processes); its usage, None if it has no folder."""
        folder = self.folder(name, scope)
        try:
            os.utime(folder)
        except OSError:
            return None
        return self.folder_usage(folder.name)

    def folder_usage(self, folder: str) -> Usage | None:
        """Bytes and last touch of a session folder (None: gone)."""
        path = self.dir / folder
        try:
            touched = path.stat().st_mtime
            size = 0
            for p in path.iterdir():
                if _GEN.match(p.name):
                    size += sum(f.stat().st_size for f in p.iterdir())
                elif p.name == EXTRA:
                    size += p.stat().st_size
        except OSError:
            return None
        return Usage(size, touched)

    def folder_scope(self, folder: str) -> str | None:
        """The scope of the session in folder `folder`, from its newest generation's
        manifest (only if the folder is that session's); None when none can be read."""
        for _, path in generations_in(self.dir / folder):
            try:
                m = read_manifest(path)
            except (OSError, SnapshotError):
                continue
            session, scope = m.get("session"), m.get("scope") or ""
            if isinstance(session, str) and isinstance(scope, str) and folder_name(session, scope) == folder:
                return scope
        return None

    def usage(self) -> dict[str, Usage]:
        """Every session folder's usage, read from disk."""
        try:
            folders = [p.name for p in self.dir.iterdir() if not p.name.startswith(".")]
        except OSError:
            return {}
        return {f: u for f in folders if (u := self.folder_usage(f)) is not None}

    def find(self, name: str, below: int | None = None, scope: str = "") -> Entry | None:
        """Session `name`'s newest complete generation (below `below`, if given); a
        newer one that fails its checks is quarantined on the way."""
        folder = self.folder(name, scope)
        if not real_dir(self.root) or not real_dir(self.dir):
            return None  # links lead out of the state directory (the scan says so)
        for generation, path in generations_in(folder):
            if below is not None and generation >= below:
                continue
            found = self._checked(path, generation, folder.name)
            if found is not None and found[0].session == name and found[0].scope == scope:
                return found[0]
        return None

    def scan(self) -> list[Entry]:
        """Every session's newest generation that passes its checks (manifests and
        headers only; the checksums are checked on use, falling back to an older
        generation); newer ones that fail are quarantined."""
        if not scannable(self.root, self.dir, self.quarantine_limit):
            return []
        try:
            folders = [f for f in self.dir.iterdir() if not f.name.startswith(".") and real_dir(f)]
        except OSError:  # unreadable: nothing to index
            return []
        found = []
        for folder in folders:
            for generation, path in generations_in(folder):
                hit = self._checked(path, generation, folder.name)
                if hit is not None:
                    found.append(hit)
                    break
        return [e for e, _ in sorted(found, key=lambda f: f[1])]

    def _checked(self, path: Path, generation: int, folder: str) -> tuple[Entry, float] | None:
        """Generation `path`'s entry and mtime; None when it fails its checks
        (quarantined when it is damaged, skipped when it only cannot be read now)."""
        try:
            return self._entry(path, generation, folder)
        except SnapshotError as err:
            quarantine(self.root, path, err, self.quarantine_limit)
            return None

    def _entry(self, path: Path, generation: int, folder: str) -> tuple[Entry, float]:
        try:
            mtime = path.lstat().st_mtime
            if path.is_symlink() or not path.is_dir():
                raise SnapshotError(f"{path}: not a snapshot folder")
            m = peek(path, self.identity, self.expect)
            session, scope = m.get("session"), m.get("scope") or ""
            if not isinstance(session, str) or folder_name(session, scope) != folder:
                raise SnapshotError(f"{path}: not a generation of the session whose folder it is in")
            return Entry(f"{folder[:12]}-g{generation}", list(m["tokens"]), path=path,
                         disk_bytes=snapshot_bytes(path), session=session, sampler=dict(m.get("sampler") or {}),
                         generation=generation, scope=scope,
                         trimmable=all(trimmable_meta(layer) for layer in m["layers"])), mtime
        except OSError as err:  # vanished or unreadable meanwhile: skipped, not damaged
            raise SnapshotError(f"{path}: cannot read it ({err.strerror or err})", damaged=False) from None


def generations_in(folder: Path) -> list[tuple[int, Path]]:
    """(generation, path) in a session folder, newest first ([] when it cannot be
    listed, or is a link: out of the state directory)."""
    if not real_dir(folder):
        return []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(((int(m.group(1)), folder / n) for n in names if (m := _GEN.match(n))), reverse=True)

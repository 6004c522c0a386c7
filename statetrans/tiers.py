"""Stored serving states in two tiers: memory, bounded in bytes, and a disk tier of
snapshots the least recently used states spill to, indexed by token prefix.

A state is anonymous (a prefix cache entry: reusable by any request whose tokens
share its prefix; its disk copy may be deleted when the disk tier is full) or a
named session's (swapped to disk when memory is short, never deleted unasked).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

import kvexec
from statetrans.prefix import PrefixTrie
from statetrans.snapshot import MANIFEST, SnapshotError, load_snapshot, save_snapshot
from statetrans.state import capture, holds, rebuild, state_bytes


@dataclass
class Entry:
    key: str
    tokens: list[int]
    cache: list | None = None  # in the memory tier
    nbytes: int = 0  # in memory
    path: Path | None = None  # in the disk tier
    disk_bytes: int = 0
    session: str | None = None
    sampler: dict = field(default_factory=dict)  # RNG position, continued on reuse
    trimmable: bool = True  # all layers can drop trailing positions (not recurrent state)
    used: int = 0  # LRU clock


@dataclass
class Reuse:
    """What a request starts from: a state holding `tokens` (a prefix of its own)."""

    cache: list | None
    tokens: list[int]
    sampler: dict
    source: str  # "memory", "disk" or "" (nothing reusable)
    seconds: float = 0.0  # spent restoring
    session: str | None = None  # the entry was this session's

    @property
    def length(self) -> int:
        return len(self.tokens)


def identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def check_identity(manifest: dict, identity: dict, where: str) -> None:
    """Refuse a snapshot computed by another model or with other KV settings."""
    if manifest.get("model") != identity.get("model"):
        raise SnapshotError(f"{where}: saved with model {manifest.get('model_name')!r} "
                            f"({manifest.get('model')}), not this engine's {identity.get('model_name')!r}")
    kv = [(m or {}).get("format", "mlx-lm") for m in (manifest.get("kv"), identity.get("kv"))]
    if manifest.get("kv") != identity.get("kv"):
        raise SnapshotError(f"{where}: saved with KV format {kv[0]} (or other KV settings), this engine uses {kv[1]}")
    if manifest.get("policy") != identity.get("policy"):
        raise SnapshotError(f"{where}: saved under PhaseSwap policy {manifest.get('policy')!r}, this engine "
                            f"runs {identity.get('policy')!r} (other weight forms compute other states)")


def copy_cache(cache: list) -> list:
    """An independent copy: the KV store writes its pages in place."""
    arrays, layers = capture(cache)
    return rebuild({k: mx.array(v) for k, v in arrays.items()}, layers)


class StateTiers:
    def __init__(self, directory: str | Path, identity: dict, layers: int,
                 memory_limit: int, disk_limit: int):
        self.identity, self.layers = identity, layers
        self.dir = Path(directory).expanduser() / identity_key(identity)
        self.memory_limit, self.disk_limit = memory_limit, disk_limit
        self.trie = PrefixTrie()
        self.entries: dict[str, Entry] = {}
        self.sessions: dict[str, str] = {}  # name -> entry key
        self.last: Entry | None = None  # the most recently stored state
        self.spilled = self.restored = 0  # counts, for stats
        self._clock = itertools.count(1)
        self._scan()

    # -- accounting ---------------------------------------------------------------
    # (list(...) copies in one step: the server reads these while its engine thread writes)
    @property
    def memory_bytes(self) -> int:
        return sum(e.nbytes for e in list(self.entries.values()) if e.cache is not None)

    @property
    def disk_bytes(self) -> int:
        return sum(e.disk_bytes for e in list(self.entries.values()) if e.path is not None)

    # -- storing --------------------------------------------------------------------
    def put(self, tokens: list[int], cache: list, session: str | None = None,
            sampler: dict | None = None) -> Entry:
        """Keep `cache` (holding exactly `tokens`) in the memory tier. It replaces an
        anonymous state with the same tokens; the session's previous state stays, as
        an anonymous one (a checkpoint the LRU tiers bound)."""
        mx.eval([c.state for c in cache])  # nothing pending is stored half-done
        same = self._same_tokens(tokens, session)
        if same is not None:
            self._forget(self.entries[same])
        e = Entry(uuid.uuid4().hex[:16], list(tokens), cache, sum(_nbytes(c) for c in cache),
                  session=session, sampler=dict(sampler or {}), trimmable=kvexec.can_trim(cache, 0))
        self._add(e)
        return e

    def _add(self, e: Entry) -> None:
        e.used = next(self._clock)
        self.entries[e.key] = e
        self.trie.insert(e.key, e.tokens)
        if e.session:
            prev = self.sessions.get(e.session)
            if prev is not None and prev != e.key:
                self.entries[prev].session = None
            self.sessions[e.session] = e.key
        self.last = e

    def _same_tokens(self, tokens: list[int], session: str | None) -> str | None:
        for n, key in self.trie.match(tokens):
            e = self.entries[key]
            if n == len(tokens) == len(e.tokens) and e.session in (None, session):
                return key
        return None

    def _forget(self, e: Entry) -> None:
        self.entries.pop(e.key, None)
        if e.key in self.trie:
            self.trie.remove(e.key)
        if e.session and self.sessions.get(e.session) == e.key:
            del self.sessions[e.session]
        if e.path is not None:
            shutil.rmtree(e.path, ignore_errors=True)
        if self.last is e:
            self.last = None
        e.cache = None

    # -- reuse ----------------------------------------------------------------------
    def take(self, tokens: list[int], session: str | None = None, memory_limit: int | None = None) -> Reuse:
        """The stored state sharing the longest usable prefix with `tokens` (at most
        all but the last token, so the request computes logits), trimmed to it, and
        detached for the request to extend. A state that is extended as it is leaves
        the index (the request's own state will cover it) unless it cannot be trimmed
        later (recurrent layers) or is another session's: those stay as checkpoints,
        on disk when memory is short. Other states spill to disk so the memory tier
        holds at most `memory_limit`."""
        limit = len(tokens) - 1
        own = self.sessions.get(session) if session else None
        candidates = [(min(n, limit), key) for n, key in self.trie.match(tokens)]
        rank = {key: (n, n == len(self.entries[key].tokens), key == own, self.entries[key].cache is not None)
                for n, key in candidates}
        for key in sorted(rank, key=lambda k: rank[k], reverse=True):
            n, e = rank[key][0], self.entries[key]
            cut = len(e.tokens) - n
            if n <= 0 or (cut and not e.trimmable):
                continue
            keep = cut > 0 or not e.trimmable or (e.session is not None and e.session != session)
            reuse = self._detach(e, keep, memory_limit)
            if reuse is None:
                continue
            if cut and not kvexec.trim(reuse.cache, cut):
                continue  # e.g. evicted positions: the copy is dropped
            reuse.tokens = reuse.tokens[:n]
            return reuse
        self.fit(memory_limit)
        return Reuse(None, [], {}, "")

    def _detach(self, e: Entry, keep: bool, memory_limit: int | None) -> Reuse | None:
        start = time.perf_counter()
        if not keep and e.cache is not None:  # hand the memory over; nothing to copy
            cache, source = e.cache, "memory"
            e.cache = None
            self._forget(e)
            self.fit(memory_limit)
        else:
            self.fit(memory_limit, spare=None if keep else e)  # spill first: the copy needs room
            if e.cache is not None:
                cache, source = copy_cache(e.cache), "memory"
            else:
                try:
                    cache, source = self._read(e.path), "disk"
                except SnapshotError:
                    self._forget(e)  # damaged or deleted under us: not reusable
                    return None
                self.restored += 1
            if keep:
                e.used = next(self._clock)
            else:
                self._forget(e)
        return Reuse(cache, list(e.tokens), dict(e.sampler), source, time.perf_counter() - start, e.session)

    # -- tiers ----------------------------------------------------------------------
    def fit(self, memory_limit: int | None = None, spare: Entry | None = None) -> None:
        """Spill least recently used states to disk until the memory tier holds at
        most `memory_limit` (default: the tier's own limit), then delete the least
        recently used anonymous snapshots past the disk limit."""
        limit = self.memory_limit if memory_limit is None else min(memory_limit, self.memory_limit)
        held = sorted((e for e in self.entries.values() if e.cache is not None and e is not spare),
                      key=lambda e: e.used)
        total = self.memory_bytes
        for e in held:
            if total <= limit:
                break
            self.spill(e)
            total -= e.nbytes
        disk = sorted((e for e in self.entries.values() if e.path is not None and e.session is None),
                      key=lambda e: e.used)
        total = self.disk_bytes
        for e in disk:
            if total <= self.disk_limit:
                break
            total -= e.disk_bytes
            if e.cache is not None:  # still in memory: only the disk copy goes
                shutil.rmtree(e.path, ignore_errors=True)
                e.path, e.disk_bytes = None, 0
            else:
                self._forget(e)

    def spill(self, e: Entry) -> None:
        """Move a state from memory to the disk tier (written once; kept while valid)."""
        if e.cache is None:
            return
        if e.path is None:
            e.path = self.dir / e.key
            e.disk_bytes = self._write(e.path, e.cache, e.tokens, {"session": e.session, "sampler": e.sampler})
        e.cache = None
        self.spilled += 1

    def _write(self, path: Path, cache: list, tokens: list[int], extra: dict) -> int:
        arrays, layers = capture(cache)
        meta = {**self.identity, "tokens": list(tokens), "layers": layers, **extra}
        return save_snapshot(path, arrays, meta)

    def export(self, e: Entry, path: str | Path, extra: dict | None = None) -> tuple[int, int]:
        """Save a state as a snapshot at `path`; returns (in-memory bytes, file bytes)."""
        if e.cache is not None:
            arrays, layers = capture(e.cache)
        else:
            arrays, manifest = load_snapshot(e.path)
            layers = manifest["layers"]
        meta = {**self.identity, "tokens": list(e.tokens), "layers": layers, "session": e.session,
                "sampler": e.sampler, "extra": extra or {}}
        return state_bytes(arrays), save_snapshot(path, arrays, meta)

    def _read(self, path: Path) -> list:
        return self.read(path)[0]

    def read(self, path: str | Path) -> tuple[list, dict, int]:
        """A snapshot's cache, manifest and in-memory bytes, checked against this
        model, its KV settings and its layers; raises SnapshotError otherwise."""
        arrays, manifest = load_snapshot(path)
        check_identity(manifest, self.identity, str(path))
        try:
            cache = rebuild(arrays, manifest["layers"])
            tokens = [int(t) for t in manifest["tokens"]]
        except (KeyError, TypeError, ValueError) as err:
            raise SnapshotError(f"{path}: inconsistent snapshot ({err})") from None
        if len(cache) != self.layers or not holds(cache, len(tokens)):
            raise SnapshotError(f"{path}: state does not match its tokens or this model's layers")
        return cache, manifest, state_bytes(arrays)

    def _scan(self) -> None:
        """Index the disk tier left by earlier runs (manifests only; checked on use)."""
        if not self.dir.is_dir():
            return
        found = []
        for d in self.dir.iterdir():
            if d.name.startswith("."):  # an interrupted write
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                m = json.loads((d / MANIFEST).read_text())
                check_identity(m, self.identity, str(d))
                found.append((d.stat().st_mtime, d, m))
            except (OSError, ValueError, SnapshotError):
                continue
        for _, d, m in sorted(found, key=lambda f: f[0]):
            disk = sum(f.stat().st_size for f in d.iterdir())
            e = Entry(d.name, [int(t) for t in m["tokens"]], path=d, disk_bytes=disk, session=m.get("session"),
                      sampler=m.get("sampler") or {},
                      trimmable=all(_trimmable_meta(layer) for layer in m.get("layers", [])))
            self._add(e)
        self.last = None

    # -- sessions -------------------------------------------------------------------
    def fork(self, source: str, name: str) -> Entry:
        """A new session `name` starting from session `source`'s state."""
        e = self.entries[self.sessions[source]]
        if e.cache is not None:
            cache = copy_cache(e.cache)
        else:
            cache = self._read(e.path)
        return self.put(e.tokens, cache, name, e.sampler)

    def drop(self, session: str) -> None:
        """Forget a session's state, on disk too."""
        if session in self.sessions:
            self._forget(self.entries[self.sessions[session]])

    def clear(self) -> None:
        """Forget every anonymous state (sessions stay)."""
        for e in [e for e in self.entries.values() if e.session is None]:
            self._forget(e)
        self.last = None


def _nbytes(c) -> int:
    n = getattr(c, "nbytes", None)
    return n if isinstance(n, int) else sum(a.nbytes for a in c.state if isinstance(a, mx.array))


def _trimmable_meta(layer: dict) -> bool:
    return layer.get("kind") == "paged" or layer.get("class") in ("KVCache", "QuantizedKVCache")

"""A state directory from the outside (`justfit state`): list what it holds, remove a
session, verify every snapshot, and collect garbage down to a size; without loading
a model, and safely beside running engines (the same lock, live owners respected)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from statetrans.disk import LOCK, discard, locked, owner_alive, sweep_temporaries
from statetrans.disk_tier import ANON
from statetrans.sessions import SESSIONS, SessionStore, generations_in
from statetrans.snapshot import SnapshotError, load_snapshot, read_manifest, snapshot_bytes


@dataclass
class Stored:
    """One snapshot in a state directory, as `justfit state` lists it."""

    path: Path
    session: str | None  # None: anonymous
    tokens: int
    bytes: int
    format: str
    model: str
    age_s: float
    generation: int = 0
    current: bool = True  # a session's newest generation (others are superseded)
    live_owner: bool = False  # anonymous: written by a process still running
    error: str = ""  # the manifest could not be read


def model_dirs(root: Path) -> list[Path]:
    """The per-model folders of a state directory."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                  and ((d / SESSIONS).is_dir() or (d / ANON).is_dir() or (d / LOCK).exists()))


def _stored(path: Path, generation: int = 0, current: bool = True) -> Stored:
    now = time.time()
    try:
        m = read_manifest(path)
        kv = m.get("kv") if isinstance(m.get("kv"), dict) else {}
        tokens = m.get("tokens")
        return Stored(path, m.get("session") if generation else None, len(tokens) if isinstance(tokens, list) else 0,
                      snapshot_bytes(path), str(kv.get("format", "mlx-lm")), str(m.get("model_name")),
                      now - path.stat().st_mtime, generation, current, owner_alive(m.get("owner")))
    except (SnapshotError, OSError) as e:
        return Stored(path, None, 0, 0, "?", "?", 0.0, generation, current, error=str(e))


def _model_dir(s: Stored) -> Path:
    """The model folder holding `s` (whose lock guards it)."""
    return s.path.parents[2] if s.generation else s.path.parents[1]


def inventory(root: Path) -> list[Stored]:
    """Every snapshot in the state directory: sessions' generations and anonymous states."""
    out = []
    for d in model_dirs(root):
        if (d / SESSIONS).is_dir():
            for folder in sorted((d / SESSIONS).iterdir()):
                for i, (generation, path) in enumerate(generations_in(folder)):
                    out.append(_stored(path, generation, current=i == 0))
        if (d / ANON).is_dir():
            out += [_stored(p) for p in sorted((d / ANON).iterdir()) if not p.name.startswith(".")]
    return out


def remove_session(root: Path, name: str) -> int:
    """Delete session `name` (for every model); how many were found."""
    return sum(SessionStore(d, {}).drop(name) for d in model_dirs(root))


def verify(root: Path, remove: bool = False) -> list[tuple[Path, str]]:
    """(path, what is wrong) for every snapshot that does not load; `remove`: delete
    those (a session keeps its older generations, which take over)."""
    broken = []
    for s in inventory(root):
        try:
            load_snapshot(s.path)
        except SnapshotError as e:
            broken.append((s.path, str(e)))
            if remove:
                with locked(_model_dir(s)):
                    discard(s.path)
    return broken


def _loads(path: Path) -> bool:
    try:
        load_snapshot(path)
    except SnapshotError:
        return False
    return True


def gc(root: Path, keep: int) -> tuple[int, int]:
    """Remove dead processes' temporaries, sessions' superseded generations (once the
    newest one loads), then anonymous states (least recently written first, never a
    live process's) until the directory holds at most `keep` bytes. Sessions are
    never removed. Returns (snapshots removed, bytes freed)."""
    removed = freed = 0
    for d in model_dirs(root):
        with locked(d):
            sweep_temporaries(d)
    items = inventory(root)
    sound = {s.path.parent for s in items if s.generation and s.current and _loads(s.path)}
    for s in items:
        if s.generation and not s.current and s.path.parent in sound:  # the newest one can take over
            with locked(_model_dir(s)):
                discard(s.path)
            removed, freed = removed + 1, freed + s.bytes
    total = sum(s.bytes for s in items if s.current)
    for s in sorted((s for s in items if not s.generation and not s.live_owner), key=lambda s: -s.age_s):
        if total <= keep:
            break
        with locked(_model_dir(s)):
            discard(s.path)
        total, removed, freed = total - s.bytes, removed + 1, freed + s.bytes
    return removed, freed

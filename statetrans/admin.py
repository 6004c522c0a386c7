"""A state directory from the outside (`justfit state`): list what it holds, remove a
session, verify every snapshot (quarantining what fails) and empty the quarantine,
and collect garbage down to a size; without loading a model, and safely beside running
engines (the same lock, live owners respected). Nothing the directory holds can make
these crash: links are not followed, files are read within bounds, and what cannot
be read is reported as such."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from statetrans.disk import LOCK, discard, locked, owner_alive, owners_of, real_dir, sweep_temporaries
from statetrans.disk_tier import ANON
from statetrans.quarantine import Quarantined, purge, quarantine, quarantine_bytes, quarantined, trim_quarantine
from statetrans.schema import Expect, check_state
from statetrans.sessions import SESSIONS, folder_name, generations_in
from statetrans.snapshot import SnapshotError, read_manifest, snapshot_bytes, verify_snapshot


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
    scope: str = ""  # whose session it is ("": the shared scope)


def _listing(folder: Path) -> list[Path]:
    """What `folder` holds, sorted; [] when it cannot be listed or is a link (out of the
    state directory: not followed)."""
    if not real_dir(folder):
        return []
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def model_dirs(root: Path) -> list[Path]:
    """The per-model folders of a state directory (which may itself be a link)."""
    try:
        found = sorted(root.iterdir())
    except OSError:
        return []
    return [d for d in found if not d.name.startswith(".") and real_dir(d)
            and (real_dir(d / SESSIONS) or real_dir(d / ANON) or os.path.lexists(d / LOCK))]


def _stored(path: Path, generation: int = 0, current: bool = True) -> Stored:
    now = time.time()
    try:
        if not real_dir(path):
            raise SnapshotError(f"{path}: not a snapshot folder")
        m = read_manifest(path)
        kv = m.get("kv") if isinstance(m.get("kv"), dict) else {}
        return Stored(path, m.get("session") if generation else None, len(m.get("tokens") or []),
                      snapshot_bytes(path), str(kv.get("format", "mlx-lm")), str(m.get("model_name")),
                      now - path.lstat().st_mtime, generation, current,
                      owner_alive(m.get("owner"), owners_of(path.parent)), scope=m.get("scope") or "")
    except (SnapshotError, OSError) as e:
        return Stored(path, None, 0, 0, "?", "?", 0.0, generation, current, error=str(e))


def _model_dir(s: Stored) -> Path:
    """The model folder holding `s` (whose lock guards it)."""
    return s.path.parents[2] if s.generation else s.path.parents[1]


def inventory(root: Path) -> list[Stored]:
    """Every snapshot in the state directory: sessions' generations and anonymous states
    (temporaries, a live writer's among them, are not snapshots yet)."""
    return [s for d in model_dirs(root) for s in _snapshots(d)]


def _snapshots(d: Path) -> list[Stored]:
    """The snapshots of model folder `d`."""
    out = []
    for folder in _listing(d / SESSIONS):
        if folder.name.startswith(".") or not real_dir(folder):
            continue
        for i, (generation, path) in enumerate(generations_in(folder)):
            out.append(_stored(path, generation, current=i == 0))
    return out + [_stored(p) for p in _listing(d / ANON) if not p.name.startswith(".")]


def remove_session(root: Path, name: str) -> int:
    """Delete session `name` (for every model, in every scope); how many were found."""
    removed = 0
    for d in model_dirs(root):
        folders = {d / SESSIONS / folder_name(name)}  # the shared scope's, even if unreadable
        folders |= {s.path.parent for s in _snapshots(d) if s.generation and s.current and s.session == name}
        for folder in folders:
            with locked(d):
                if not os.path.lexists(folder):
                    continue
                discard(folder)
            removed += 1
    return removed


def _check(s: Stored) -> None:
    """Raise SnapshotError unless `s` passes every check its model's engine makes that
    needs no model: checksums, header, structure, tokens, and a session generation
    in its own session's folder."""
    def check(manifest: dict, shapes: dict) -> None:
        check_state(manifest, shapes, Expect(), str(s.path))
        if s.generation and (not isinstance(manifest.get("session"), str) or folder_name(
                manifest["session"], manifest.get("scope") or "") != s.path.parent.name):
            raise SnapshotError(f"{s.path}: not a generation of the session whose folder it is in")
        if not s.generation and manifest.get("session") is not None:
            raise SnapshotError(f"{s.path}: a session's state among the anonymous ones")

    if not real_dir(s.path):
        raise SnapshotError(f"{s.path}: not a snapshot folder")
    verify_snapshot(s.path, check)


def verify(root: Path, limit: int | None = None) -> tuple[int, list[tuple[Path, str, Path | None]]]:
    """Check every snapshot (without reading its arrays beyond their checksum); the
    broken ones are quarantined (a session's older generation takes over), then each
    model folder's quarantine is trimmed to `limit` bytes, oldest first (None: left
    as it is). Returns how many were checked and (path, what is wrong, where it was
    quarantined: None when it was only unreadable now) for each that failed."""
    items = inventory(root)
    broken = []
    for s in items:
        try:
            _check(s)
        except SnapshotError as e:
            broken.append((s.path, str(e), quarantine(_model_dir(s), s.path, e, limit)))
    if limit is not None:
        for d in model_dirs(root):
            trim_quarantine(d, limit)
    return len(items), broken


def quarantine_items(root: Path) -> list[Quarantined]:
    """What the quarantine folders of the state directory hold."""
    return [q for d in model_dirs(root) for q in quarantined(d)]


def purge_quarantine(root: Path) -> int:
    """Delete everything quarantined; how many items."""
    items = quarantine_items(root)
    for q in items:
        with locked(q.path.parents[1]):
            purge(q)
    return len(items)


def _sound(s: Stored) -> bool:
    try:
        _check(s)
    except SnapshotError:
        return False
    return True


def gc(root: Path, keep: int) -> tuple[int, int]:
    """Remove dead processes' temporaries, sessions' superseded generations (once the
    newest one passes verify's checks), then anonymous states (least recently written first, never a
    live process's) until the directory holds at most `keep` bytes, its quarantine
    counted. Sessions are never removed. Returns (snapshots removed, bytes freed)."""
    removed = freed = 0
    for d in model_dirs(root):
        with locked(d):
            sweep_temporaries(d)
    items = inventory(root)
    sound = {s.path.parent for s in items if s.generation and s.current and not s.error and _sound(s)}
    doomed = [s for s in items if s.generation and not s.current and s.path.parent in sound]
    total = sum(s.bytes for s in items if s.current) + sum(quarantine_bytes(d) for d in model_dirs(root))
    for s in sorted((s for s in items if not s.generation and not s.live_owner and not s.error),
                    key=lambda s: -s.age_s):
        if total <= keep:
            break
        doomed.append(s)
        total -= s.bytes
    for s in doomed:
        try:
            with locked(_model_dir(s)):
                discard(s.path)
        except OSError:
            continue
        removed, freed = removed + 1, freed + s.bytes
    return removed, freed

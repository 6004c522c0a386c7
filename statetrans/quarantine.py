"""Quarantine: a stored state that fails its checks (at a scan, a load or `justfit
state verify`) is moved, in one rename under the directory lock, into its model
folder's `quarantine/`, under a timestamped unique name with a note of what was wrong
beside it, and a warning is logged; whoever found it carries on without it. The
quarantine is bounded: past its limit (statetrans.quota.quarantine_limit) the oldest
items are deleted first, the one just moved last (`justfit state verify --remove`
empties it). A live process's temporaries are never touched (scans skip them), and a
snapshot is only moved if it is still the one that was read: one that vanished or was
replaced meanwhile stays where it is."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from statetrans.disk import fsync_path, locked, real_dir, remove
from statetrans.snapshot import SnapshotError, read_json_file, stamp_of

QUARANTINE = "quarantine"
NOTE = ".why.json"  # suffix of the note kept beside a quarantined item

log = logging.getLogger("justfit.statetrans")


def quarantine(root: Path, path: Path, err: BaseException | str, limit: int | None = None) -> Path | None:
    """Move `path` (a snapshot under model folder `root`) into `root/quarantine/`,
    saying why (`err`), then delete the oldest quarantined items past `limit` bytes
    (None: no limit); returns where it went, or None when it was not moved: a
    SnapshotError that is not damage (unreadable now, gone), a path replaced or gone
    since it was read, or a move that failed (logged)."""
    why = str(err)[:2000]
    if isinstance(err, SnapshotError) and not err.damaged:
        log.warning("not using a stored state: %s", why)
        return None
    stamp = err.stamp if isinstance(err, SnapshotError) else None
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{'-'.join(rel.parts)[:120]}-{uuid.uuid4().hex[:8]}"
    dest = root / QUARANTINE / name
    try:
        with locked(root):
            if not os.path.lexists(path) or (stamp is not None and stamp_of(path) != stamp):
                return None  # gone or replaced since it was read: not the one that failed
            dest.parent.mkdir(exist_ok=True)
            os.rename(path, dest)
            note = {"from": str(rel), "reason": why, "at": time.time()}
            (dest.parent / (name + NOTE)).write_text(json.dumps(note, ensure_ascii=True))
            if limit is not None:
                _trim(root, limit)
        fsync_path(dest.parent)
        fsync_path(path.parent)
    except OSError as e:
        log.warning("a stored state failed its checks (%s) and could not be quarantined: %s", why, e)
        return None
    log.warning("quarantined a stored state (%s) as %s", why, dest)
    return dest


def scannable(root: Path, folder: Path, limit: int | None = None) -> bool:
    """Whether `folder` (anon/ or sessions/ of model folder `root`) is there to scan.
    A link in place of either leads out of the state directory, so it is not followed:
    a linked model folder is left alone (logged), a linked (or file) anon/ or sessions/
    quarantined (within `limit`), the link itself, not what it points to."""
    if not os.path.lexists(folder):
        return False
    if not real_dir(root):
        log.warning("not reading stored states through %s: a link, not a folder", root)
        return False
    if not real_dir(folder):
        quarantine(root, folder, SnapshotError(f"{folder} is not a folder (a link or a file)"), limit)
        return False
    return True


@dataclass
class Quarantined:
    """An item in a quarantine folder, as `justfit state verify` reports it."""

    path: Path
    source: str  # where it was, relative to its model folder
    reason: str
    at: float  # when it was quarantined (seconds since the epoch)
    bytes: int = 0  # on disk, its note included


def quarantined(root: Path) -> list[Quarantined]:
    """What model folder `root`'s quarantine holds, oldest first."""
    folder = root / QUARANTINE
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return []
    out = []
    for name in names:
        if name.endswith(NOTE):
            continue
        try:
            note = read_json_file(folder / (name + NOTE), name + NOTE)
        except (OSError, SnapshotError):
            note = {}
        note = note if isinstance(note, dict) else {}
        at = note.get("at")
        out.append(Quarantined(folder / name, str(note.get("from", "?")), str(note.get("reason", "?")),
                               at if type(at) in (int, float) else 0.0,
                               tree_bytes(folder / name) + tree_bytes(folder / (name + NOTE))))
    return sorted(out, key=lambda q: (q.at, q.path.name))


def quarantine_bytes(root: Path) -> int:
    """Bytes model folder `root`'s quarantine holds (what counts against its limit and
    the state directory's)."""
    return tree_bytes(root / QUARANTINE)


def trim_quarantine(root: Path, limit: int) -> list[Quarantined]:
    """Delete model folder `root`'s oldest quarantined items until it holds at most
    `limit` bytes (under the directory lock); what was deleted."""
    if not os.path.lexists(root / QUARANTINE):
        return []
    with locked(root):
        return _trim(root, limit)


def _trim(root: Path, limit: int) -> list[Quarantined]:
    """`trim_quarantine`, the directory lock held."""
    items = quarantined(root)
    total = sum(q.bytes for q in items)
    gone = []
    for q in items:  # oldest first
        if total <= limit:
            break
        purge(q)
        total -= q.bytes
        gone.append(q)
    if gone:
        log.warning("the quarantine of %s is over its limit of %d bytes: deleted its %d oldest items (%d bytes)",
                    root, limit, len(gone), sum(q.bytes for q in gone))
    return gone


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (itself if a file or a link), links not followed."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for folder, _, files in os.walk(path):  # (os.walk follows no link by default)
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue  # gone meanwhile
    return total


def purge(item: Quarantined) -> None:
    """Delete a quarantined item and its note."""
    remove(item.path)
    remove(item.path.with_name(item.path.name + NOTE))

"""File-system primitives the disk tiers share: fsync of files and directories,
temporaries named by their owner's PID, a per-directory fcntl lock, and owner tags
telling a live process's states from a dead one's."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

LOCK = ".lock"
_TEMP = re.compile(r"^\.(?:.*\.)?(?:tmp|old)-(\d+)(?:-.*)?$")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: its entries, i.e. renames in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(stem: str = "") -> str:
    """A unique temporary name carrying this process's PID (see `temp_owner`)."""
    return f".{stem + '.' if stem else ''}tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_owner(name: str) -> int | None:
    """The PID that owns temporary `name`; None when it is not a temporary."""
    m = _TEMP.match(name)
    return int(m.group(1)) if m else None


def alive(pid: int) -> bool:
    """Whether process `pid` exists (this process always does)."""
    return pid == os.getpid() or psutil.pid_exists(pid)


def owner_tag() -> dict:
    """Who wrote a state: this process, by PID and start time (PIDs are reused)."""
    return {"pid": os.getpid(), "started": round(psutil.Process().create_time(), 2)}


def owner_alive(tag) -> bool:
    """Whether the process that wrote a state still runs (no tag: nobody's)."""
    if not isinstance(tag, dict) or not isinstance(tag.get("pid"), int):
        return False
    if tag["pid"] == os.getpid():
        return True
    try:
        return round(psutil.Process(tag["pid"]).create_time(), 2) == tag.get("started")
    except (psutil.Error, OSError):
        return False


def mine(tag) -> bool:
    """Whether owner tag `tag` names this process."""
    return isinstance(tag, dict) and tag.get("pid") == os.getpid()


def sweep_temporaries(directory: Path, depth: int = 2) -> list[Path]:
    """Remove temporaries under `directory` whose owner process is dead (a live
    process's in-flight write is left alone); returns what was removed."""
    removed: list[Path] = []
    if depth < 0 or not directory.is_dir():
        return removed
    for p in directory.iterdir():
        pid = temp_owner(p.name)
        if pid is not None:
            if not alive(pid):
                remove(p)
                removed.append(p)
        elif p.is_dir() and not p.is_symlink():
            removed += sweep_temporaries(p, depth - 1)
    return removed


def discard(path: Path) -> None:
    """Delete `path` so that a crash midway leaves nothing but a temporary (swept once
    this process is dead): one rename out of the way, then the removal."""
    if not path.exists():
        return
    doomed = path.with_name(temp_name(path.name))
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    remove(doomed)


def remove(path: Path) -> None:
    """Delete a file or a directory tree, whichever it is (gone already is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `directory` (its .lock file) for changes to what
    it holds. Each hold opens its own descriptor, so threads of one process exclude
    each other too, as other processes do."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock

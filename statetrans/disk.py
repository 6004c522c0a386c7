"""File-system primitives the disk tiers share: fsync of files and directories,
temporaries named by their owner, a per-directory fcntl lock, and owner tags telling a
live process's states from a dead one's.

An owner is a process: its PID, its start time and a random id drawn the first time it
needs one (a forked child draws its own). PIDs alone do not tell processes apart where
containers share a volume (two servers there may both be PID 1), so in each state
directory a process writes to it holds `.owners/<id>` under an exclusive fcntl lock for
its whole life; the kernel drops the lock however the process ends, so an owner is
alive exactly while its lock file is locked. Where no lock file is found (another
directory, or it was removed), the PID and start time decide. Temporaries carry the
owner in their names (`.STEM.tmp-PID-START-ID-RANDOM`), anonymous states in their owner
tag; names and tags written by older versions (PID only) are judged by the PID as before.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import psutil

LOCK = ".lock"
OWNERS = ".owners"
_NEW_TEMP = re.compile(r"^\.(?:.*\.)?(?:tmp|old)-([0-9]{1,10})-([0-9]{1,14})-([0-9a-f]{16})-[0-9a-f]{8}$")
_TEMP = re.compile(r"^\.(?:.*\.)?(?:tmp|old)-([0-9]{1,10})(?:-.*)?$", re.S)
_ID = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class Owner:
    """Who wrote a temporary or a state: a PID, its start time (centiseconds since the
    epoch) and a random per-process id; the last two are None in older versions' names."""

    pid: int
    started: int | None = None
    id: str | None = None


@dataclass
class _Process:
    """This process as an owner, and the lock files it holds (folder -> descriptor)."""

    owner: Owner
    held: dict[str, int] = field(default_factory=dict)


_guard = threading.Lock()
_me: list[_Process] = []  # this process's identity, made on first use (a forked child remakes it)
_hooked: list[bool] = []  # the fork hook is registered (on first use, not at import)


def _start_time(pid: int) -> int | None:
    try:
        return round(psutil.Process(pid).create_time() * 100)
    except (psutil.Error, OSError, ValueError):
        return None


def _forked() -> None:
    """In a forked child: the parent's identity and lock descriptors are not its own."""
    for fd in _me[0].held.values() if _me else ():
        try:
            os.close(fd)  # the parent's lock stays: its open file description lives on there
        except OSError:
            pass
    _me.clear()


def me() -> Owner:
    """This process as an owner."""
    with _guard:
        if not _me or _me[0].owner.pid != os.getpid():
            if not _hooked:
                _hooked.append(True)
                os.register_at_fork(after_in_child=_forked)
            _me[:] = [_Process(Owner(os.getpid(), _start_time(os.getpid()), os.urandom(8).hex()))]
        return _me[0].owner


def claim(directory: Path) -> None:
    """Hold this process's lock file in `directory`'s owners folder from now until it
    exits (once per folder), so other processes, in other containers too, see its
    temporaries and states there as a live owner's. Raises OSError when the folder
    cannot be written (then the PID and start time are all others go by)."""
    owner = me()
    folder = directory / OWNERS
    key = os.path.realpath(folder)
    with _guard:
        if key in _me[0].held:
            return
        _release_removed(_me[0].held)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / owner.id
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # ours alone; a tester holds it only for a moment
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                break  # not reaped between the open and the lock
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": owner.pid, "started": owner.started}).encode())
    with _guard:
        if _me and _me[0].owner == owner:
            _me[0].held[key] = fd
            return
    os.close(fd)  # forked meanwhile: the child's claim is its own


def _release_removed(held: dict[str, int]) -> None:
    """Close the lock files whose state directory was deleted (a process that goes
    through many, as tests do, would otherwise keep a descriptor for each)."""
    for key, fd in list(held.items()):
        try:
            gone = os.fstat(fd).st_nlink == 0
        except OSError:
            gone = True
        if gone:
            del held[key]
            try:
                os.close(fd)
            except OSError:
                pass


def owners_of(directory: Path, levels: int = 4) -> Path | None:
    """The owners folder that governs `directory`: its own or the nearest of its
    `levels` - 1 parents' (a session's folder is three below the state directory)."""
    for d in [directory, *directory.parents][:levels]:
        if (d / OWNERS).is_dir():
            return d / OWNERS
    return None


def _locked_by_owner(owners: Path | None, oid: str) -> bool | None:
    """Whether owner `oid`'s lock file in `owners` is held; None when there is none."""
    if owners is None or not _ID.match(oid):
        return None
    try:
        fd = os.open(owners / oid, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) or None
    finally:
        os.close(fd)  # releases the shared lock if we took it
    return False


def owner_live(owner: Owner, owners: Path | None = None) -> bool:
    """Whether `owner` still runs: this process; an owner holding its lock file in
    `owners`; else (no lock file to go by) a process with its PID and start time."""
    mine_now = me()
    if owner.id is not None:
        if owner.id == mine_now.id:
            return True
        held = _locked_by_owner(owners, owner.id)
        if held is not None:
            return held
    if owner.pid == mine_now.pid and owner.id is None:
        return True  # an older version's name: the PID is all it says
    if not 0 < owner.pid < 2**31:
        return False
    if owner.started is None:
        return psutil.pid_exists(owner.pid)
    return _start_time(owner.pid) == owner.started


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: its entries, i.e. renames in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(stem: str = "") -> str:
    """A unique temporary name carrying this process as its owner (see `temp_tag`)."""
    o = me()
    return f".{stem + '.' if stem else ''}tmp-{o.pid}-{o.started or 0}-{o.id}-{uuid.uuid4().hex[:8]}"


def temp_tag(name: str) -> Owner | None:
    """The owner of temporary `name`; None when it is not a temporary."""
    m = _NEW_TEMP.match(name)
    if m:
        return Owner(int(m.group(1)), int(m.group(2)) or None, m.group(3))
    m = _TEMP.match(name)
    return Owner(int(m.group(1))) if m else None


def temp_owner(name: str) -> int | None:
    """The PID that owns temporary `name`; None when it is not a temporary."""
    tag = temp_tag(name)
    return tag.pid if tag is not None else None


def temp_alive(path: Path) -> bool:
    """Whether temporary `path`'s owner still runs (False: not a temporary)."""
    tag = temp_tag(path.name)
    return tag is not None and owner_live(tag, owners_of(path.parent))


def temp_mine(name: str) -> bool:
    """Whether temporary `name` is this process's own."""
    tag = temp_tag(name)
    if tag is None:
        return False
    return tag.id == me().id if tag.id is not None else tag.pid == os.getpid()


def alive(pid: int) -> bool:
    """Whether process `pid` exists (this process always does)."""
    return pid == os.getpid() or (0 < pid < 2**31 and psutil.pid_exists(pid))


def owner_tag() -> dict:
    """Who wrote a state: this process, by PID, start time (PIDs are reused) and id
    (PIDs repeat across containers)."""
    o = me()
    return {"pid": o.pid, "started": round(o.started / 100, 2) if o.started is not None else None, "id": o.id}


def _tag_owner(tag) -> Owner | None:
    """The owner an owner tag names; None for no tag or a malformed one."""
    if not isinstance(tag, dict) or type(tag.get("pid")) is not int:
        return None
    started = tag.get("started")
    oid = tag.get("id")
    cs = round(started * 100) if type(started) in (int, float) and 0 <= started < 2**40 else None
    return Owner(tag["pid"], cs, oid if isinstance(oid, str) and _ID.match(oid) else None)


def owner_alive(tag, owners: Path | None = None) -> bool:
    """Whether the process that wrote a state still runs (no tag: nobody's); `owners`:
    the owners folder of the state directory it is in."""
    owner = _tag_owner(tag)
    if owner is None:
        return False
    if owner.id is None and owner.pid == os.getpid():
        return True
    if owner.id is None and owner.started is not None and 0 < owner.pid < 2**31:
        # An older version's tag: PID and start time, rounded to 10 ms as written.
        try:
            return round(psutil.Process(owner.pid).create_time(), 2) == tag.get("started")
        except (psutil.Error, OSError, ValueError):
            return False
    return owner_live(owner, owners) if owner.id is not None else False


def mine(tag) -> bool:
    """Whether owner tag `tag` names this process."""
    owner = _tag_owner(tag)
    if owner is None:
        return False
    return owner.id == me().id if owner.id is not None else owner.pid == os.getpid()


def _entries(directory: Path) -> list[Path]:
    """What `directory` holds; [] when it cannot be listed."""
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def real_dir(path: Path) -> bool:
    """Whether `path` is a directory itself, not a link to one (what the state
    directory's own folders always are: a link there leads out of it)."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def sweep_temporaries(directory: Path, depth: int = 2, owners: Path | None = None) -> list[Path]:
    """Remove temporaries under `directory` whose owner process is dead (a live
    process's in-flight write is left alone), then the lock files of dead owners;
    returns what was removed. `owners`: the owners folder (default: `directory`'s or
    its parent's). Links are not followed, except `directory` itself at depth 0 (a
    state directory may be a link to where the space is)."""
    owners = owners if owners is not None else owners_of(directory)
    removed: list[Path] = []
    if depth < 0 or (depth > 0 and not real_dir(directory)):
        return removed
    for p in _entries(directory):
        tag = temp_tag(p.name)
        try:
            if tag is not None:
                if not owner_live(tag, owners):
                    remove(p)
                    removed.append(p)
            elif p.name != OWNERS and stat.S_ISDIR(p.lstat().st_mode):
                removed += sweep_temporaries(p, depth - 1, owners)
        except OSError:
            continue  # e.g. gone meanwhile, or not ours to read
    if owners is not None and owners.parent == directory:
        _reap(owners)
    return removed


def _reap(owners: Path) -> None:
    """Remove the lock files of owners that have exited (none holds its lock)."""
    current = me().id
    for p in _entries(owners):
        if p.name == current or not _ID.match(p.name):
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            p.unlink(missing_ok=True)  # under its lock: a claim racing this one sees another inode
        except OSError:
            pass  # held: its owner lives
        finally:
            os.close(fd)


def discard(path: Path) -> None:
    """Delete `path` so that a crash midway leaves nothing but a temporary (swept once
    this process is dead): one rename out of the way, then the removal."""
    if not os.path.lexists(path):
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

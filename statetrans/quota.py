"""Disk quotas of stored states, as policies that decide and return (their owners
apply them: statetrans.session_ledger, statetrans.tiers): the default size of a state
directory, its split between named sessions, anonymous states and the quarantine, the
shares of scopes, and which sessions the sessions' quota evicts.

Sessions are counted apart from anonymous states (a prefix cache's churn never evicts
a conversation); the quarantine's bytes come out of the anonymous states' part. Past
their limit the least recently touched sessions go first (touched: written or resumed,
by any process: a session folder's mtime); one touched within `keep_s` goes only when
nothing older is left, and each write says how many such recent sessions it had to
evict. The session just written is never evicted, so the newest sessions are the ones
kept.

Where the limit is divided among scopes (a server's API keys), each of them has an
equal share of it and a write evicts only its own scope's sessions, never another's;
states of scopes without a share (written before the keys changed, say) share what the
others leave of the limit."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping

from statetrans.sessions import Usage

STATE_DISK_CAP = 20 * 2**30  # the default state directory size at most ...
FREE_SHARE = 0.5  # ... and at most this share of the free space where it lives
SESSION_SHARE = 0.75  # of the total, what sessions may hold (the rest: anonymous states)
QUARANTINE_SHARE = 0.05  # of the total, what the quarantine may hold (out of the anonymous states' part)
SESSION_KEEP_S = 600.0  # a session touched this recently is "recent"
REFRESH_S = 30.0  # the ledger is re-read from disk this often (other processes write too)


def default_state_disk(path: str | Path) -> int:
    """A state directory's default size: the smaller of 20 GiB and half the free space
    of the file system that holds (or will hold) `path`."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return STATE_DISK_CAP
    return int(min(STATE_DISK_CAP, free * FREE_SHARE))


def split_state_disk(total: int) -> tuple[int, int]:
    """(sessions' limit, anonymous states' limit) of a state directory of `total` bytes:
    sessions 3/4 (user data), anonymous states the remaining 1/4 (a cache)."""
    sessions = int(total * SESSION_SHARE)
    return sessions, total - sessions


def quarantine_limit(total: int, anonymous: int) -> int:
    """The quarantine's limit in a state directory of `total` bytes whose anonymous
    states may hold `anonymous`: 1/20 of the total, at most the anonymous part (whose
    bytes it takes)."""
    return max(0, min(int(total * QUARANTINE_SHARE), anonymous))


def share(limit: int, scope: str, scopes: frozenset[str]) -> int | None:
    """`scope`'s own share of `limit` when the limit is divided among `scopes` (equal
    parts); None when `scope` has none (then it shares what the others leave)."""
    return limit // len(scopes) if scope in scopes else None


def unshared_limit(limit: int, shared_bytes: int) -> int:
    """What the states of scopes without a share may hold together: what the scopes
    with one (holding `shared_bytes`, each within its share) leave of `limit`."""
    return limit - shared_bytes


def anonymous_room(disk_limit: int, quarantined: int) -> int:
    """What the anonymous states may hold on disk: their limit less the quarantine's
    bytes (negative when the quarantine holds more: then none may stay)."""
    return disk_limit - quarantined


def anonymous_shares(room: int, scopes: frozenset[str]) -> dict[str, int]:
    """Each of `scopes`' share of the anonymous states' `room`."""
    return {scope: max(0, room) // len(scopes) for scope in scopes}


@dataclass(frozen=True)
class DiskShares:
    """One scope's disk shares in bytes (None: no share of its own, or no limit)."""

    sessions: int | None
    anonymous: int | None

    def as_dict(self) -> dict[str, int | None]:
        """{"sessions": ..., "anonymous": ...}."""
        return {"sessions": self.sessions, "anonymous": self.anonymous}


def disk_shares(session_limit: int | None, room: int, scope: str, scopes: frozenset[str]) -> DiskShares:
    """`scope`'s shares of the sessions' limit (None: unbounded) and of the anonymous
    states' `room` (anonymous_room) when the limits are divided among `scopes`."""
    return DiskShares(None if session_limit is None else share(session_limit, scope, scopes),
                      share(max(0, room), scope, scopes))


@dataclass(frozen=True)
class Trim:
    """Evict from `folders`, in `order` (least recently touched first; never the
    session just written), until they hold at most `limit` bytes less what the folders
    of `less` hold then (the scopes with a share: applied after those were trimmed)."""

    folders: frozenset[str]
    order: tuple[str, ...]
    limit: int
    less: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SessionQuota:
    """The sessions' disk limit over one model's session folders (all scopes, all
    processes), divided among `scopes` when there are any. `decide` says which of them
    to evict from a snapshot of their usage; the ledger that owns the snapshot applies
    it (statetrans.session_ledger)."""

    limit: int | None = None  # None: unbounded
    keep_s: float = SESSION_KEEP_S
    refresh_s: float = REFRESH_S  # the owner re-reads its snapshot from disk this often
    scopes: frozenset[str] = frozenset()

    def shared_among(self, scopes: Iterable[str]) -> SessionQuota:
        """This quota with its limit divided among `scopes` instead (none: one share for all)."""
        return replace(self, scopes=frozenset(scopes))

    def decide(self, usage: Mapping[str, Usage], scope_of: Mapping[str, str | None], spare: str,
               scope: str = "") -> tuple[Trim, ...]:
        """What to evict after a write of folder `spare` (of `scope`), given each
        folder's usage and scope (absent or None: unknown): first `scope`'s sessions to
        its share (when the limit is divided), then the sessions of scopes without a
        share to what the others leave of the limit. Applied in order."""
        if self.limit is None:
            return ()
        trims = []
        own = share(self.limit, scope, self.scopes)
        if own is not None:
            trims.append(self._trim(usage, {f for f in usage if scope_of.get(f) == scope}, own, spare))
        rest = {f for f in usage if scope_of.get(f) not in self.scopes}
        trims.append(self._trim(usage, rest, self.limit, spare, frozenset(usage) - rest))
        return tuple(trims)

    def recent(self, touched: float, now: float) -> bool:
        """Whether a session last touched at `touched` is a recent one at wall time `now`."""
        return now - touched < self.keep_s

    @staticmethod
    def _trim(usage: Mapping[str, Usage], folders: set[str], limit: int, spare: str,
              less: frozenset[str] = frozenset()) -> Trim:
        order = tuple(f for _, f in sorted((usage[f].touched, f) for f in folders if f != spare))
        return Trim(frozenset(folders), order, limit, less)

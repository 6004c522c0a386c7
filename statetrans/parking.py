"""A running sequence's state set aside on disk (preemption) and taken back exactly.

A batch that would outgrow its budget parks its most recently admitted sequence: the
state is written as an anonymous snapshot of the disk tier (so a process killed while
it waits leaves a reusable prefix state, found by the next one's scan) but kept out of
the index, so no other request takes it and the disk tier's clean-up never deletes
it. `unpark` reads it back, checked against the model and its tokens, and deletes the
file; `keep_parked` hands a parked state to the index instead (its request was cancelled:
what it computed stays reusable without being read)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from statetrans.index import Entry
from statetrans.snapshot import SnapshotError
from statetrans.state import capture, trimmable_meta

if TYPE_CHECKING:
    from statetrans.tiers import StateTiers


@dataclass
class Parked:
    """A parked state: its snapshot, the tokens it holds, and what parking cost."""

    path: Path
    tokens: list[int]
    disk_bytes: int
    owner: dict
    sampler: dict
    trimmable: bool
    write_s: float  # capturing and publishing the snapshot
    scope: str = ""  # whose request it was: indexed in that scope only


def park(tiers: StateTiers, tokens: list[int], cache: list, sampler: dict | None = None, scope: str = "") -> Parked:
    """Write `cache` (holding exactly `tokens`) to disk; the caller lets the cache go.
    Raises (nothing published) when the write fails: the caller keeps the cache."""
    start = time.perf_counter()
    arrays, layers = capture(cache, lazy=True)
    e = Entry(uuid.uuid4().hex[:16], list(tokens), sampler=dict(sampler or {}), scope=scope)
    path, size, owner = tiers.disk.write(e, arrays, layers)
    return Parked(path, list(tokens), size, owner, e.sampler, all(trimmable_meta(m) for m in layers),
                  time.perf_counter() - start, scope)


def unpark(tiers: StateTiers, parked: Parked) -> tuple[list, float]:
    """The parked cache, read back and checked, and the seconds reading took; the
    snapshot is deleted once read. Raises SnapshotError for a damaged or foreign one."""
    start = time.perf_counter()
    cache, manifest, _ = tiers.read(parked.path)
    if [int(t) for t in manifest["tokens"]] != parked.tokens:
        raise SnapshotError(f"{parked.path}: a parked state holds other tokens than were parked")
    tiers.disk.delete(_entry(parked))
    return cache, time.perf_counter() - start


def keep_parked(tiers: StateTiers, parked: Parked) -> None:
    """Index a parked state as an ordinary anonymous disk state (the prefix cache's),
    unless the index already holds those tokens."""
    e = _entry(parked)
    if tiers.index.same_tokens(e.tokens, None, e.scope) is not None:
        tiers.disk.delete(e)
        return
    tiers.index.add(e)
    tiers.fit()


def _entry(parked: Parked) -> Entry:
    return Entry(parked.path.name, list(parked.tokens), path=parked.path, disk_bytes=parked.disk_bytes,
                 sampler=dict(parked.sampler), owner=parked.owner, trimmable=parked.trimmable, scope=parked.scope)

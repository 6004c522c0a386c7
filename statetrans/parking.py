"""A running sequence's state set aside on disk (preemption) and taken back exactly.

A batch that would outgrow its budget parks its most recently admitted sequence: the
state is written as an anonymous snapshot of the disk tier (so a process killed while
it waits leaves a reusable prefix state, found by the next one's scan) but kept out of
the index, so no other request takes it and the disk tier's clean-up never deletes
it. `unpark` reads it back, checked against the model and its tokens, and deletes the
file; `keep_parked` hands a parked state to the index instead (its request was cancelled:
what it computed stays reusable without being read).

This module decides and returns (what to write, the `Parked` record of what was
written, whether a read-back state is the one parked, what to index); the tiers
(statetrans.tiers: `park_state`, `unpark_state`, `keep_parked_state`) write, read,
delete and index. `park`, `unpark` and `keep_parked` ask the tiers given to."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from statetrans.index import Entry
from statetrans.snapshot import SnapshotError
from statetrans.state import trimmable_meta


@dataclass(frozen=True)
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


class ParkingTiers(Protocol):
    """What parking asks of the tiers (statetrans.tiers.StateTiers)."""

    def park_state(self, tokens: list[int], cache: list, sampler: dict | None, scope: str) -> Parked:
        """Write the state, kept out of the index; its record."""

    def unpark_state(self, parked: Parked) -> tuple[list, float]:
        """The parked cache read back, checked and its snapshot deleted; the seconds it took."""

    def keep_parked_state(self, parked: Parked) -> None:
        """Index the parked state (or delete it when its tokens are held already)."""


def to_park(tokens: list[int], sampler: dict | None = None, scope: str = "") -> Entry:
    """The anonymous disk-tier entry a state holding `tokens` is parked as (never indexed while parked)."""
    return Entry(uuid.uuid4().hex[:16], list(tokens), sampler=dict(sampler or {}), scope=scope)


def parked_as(e: Entry, path: Path, size: int, owner: dict, layers: list[dict], write_s: float) -> Parked:
    """The record of entry `e` parked at `path` (`size` bytes, written by `owner`) with per-layer `layers`."""
    return Parked(path, list(e.tokens), size, owner, dict(e.sampler), all(trimmable_meta(m) for m in layers),
                  write_s, e.scope)


def check_unparked(parked: Parked, manifest: dict) -> None:
    """Raises SnapshotError unless the snapshot read back (its `manifest`) holds the tokens parked."""
    if [int(t) for t in manifest["tokens"]] != parked.tokens:
        raise SnapshotError(f"{parked.path}: a parked state holds other tokens than were parked")


def parked_entry(parked: Parked) -> Entry:
    """A parked state as a disk-tier entry (to delete, or to index as the prefix cache's)."""
    return Entry(parked.path.name, list(parked.tokens), path=parked.path, disk_bytes=parked.disk_bytes,
                 sampler=dict(parked.sampler), owner=parked.owner, trimmable=parked.trimmable, scope=parked.scope)


def park(tiers: ParkingTiers, tokens: list[int], cache: list, sampler: dict | None = None,
         scope: str = "") -> Parked:
    """Write `cache` (holding exactly `tokens`) to disk; the caller lets the cache go.
    Raises (nothing published) when the write fails: the caller keeps the cache."""
    return tiers.park_state(tokens, cache, sampler, scope)


def unpark(tiers: ParkingTiers, parked: Parked) -> tuple[list, float]:
    """The parked cache, read back and checked, and the seconds reading took; the
    snapshot is deleted once read. Raises SnapshotError for a damaged or foreign one."""
    return tiers.unpark_state(parked)


def keep_parked(tiers: ParkingTiers, parked: Parked) -> None:
    """Index a parked state as an ordinary anonymous disk state (the prefix cache's),
    unless the index already holds those tokens."""
    tiers.keep_parked_state(parked)

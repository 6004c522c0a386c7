"""Retention: which pages a store keeps when `KVConfig.max_positions` bounds it (or
the pressure ladder's floor is passed with past_floor="retain"). Pinned positions (the
prompt) and sinks are never dropped; among the rest the policy chooses."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvexec.attention import Block
from kvexec.segments import Segment

if TYPE_CHECKING:
    from kvexec.store import PageStore

POLICIES = ("score", "random")


class RetentionPolicy:
    """What a store drops first: "score", the least attended segment (oldest first
    among equals), or "random", from a seeded generator a snapshot carries."""

    def __init__(self, name: str):
        if name not in POLICIES:
            raise ValueError(f"retention policy must be score or random, not {name!r}")
        self.name = name
        self.rng = random.Random(0)

    def drop_one(self, store: PageStore) -> bool:
        """Drop one unpinned segment of `store`; False when none is left to drop."""
        segments = store.segments
        movable = [i for i, s in enumerate(segments) if s.start >= max(store.pinned, store.sinks)]
        if not movable:
            return False
        if self.name == "random":
            i = self.rng.choice(movable)
        else:
            i = min(movable, key=lambda j: (segments[j].score, j))
        store.evicted += segments.pop(i).length
        return True

    def evict(self, store: PageStore) -> None:
        """Drop generated (unpinned) pages until `store` retains max_positions."""
        budget = store.config.max_positions
        if budget is None:
            return
        while store.retained() > budget and self.drop_one(store):
            pass  # stops with only pinned tokens left; the planner refuses such requests up front


def observe(block: Block, mass: float) -> None:
    """Credit a segment with the attention mass its block received (summed over heads
    and queries): the "score" policy drops the least attended."""
    if isinstance(block.tag, Segment):
        block.tag.score += mass

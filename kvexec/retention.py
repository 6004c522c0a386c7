"""Retention: which pages a store keeps when `KVConfig.max_positions` bounds it (or
the pressure ladder's floor is passed with past_floor="retain"). Pinned positions (the
prompt) and sinks are never dropped; among the rest the policy chooses, and the store
(kvexec/store.py) drops what it chose."""

from __future__ import annotations

import random

from kvexec.attention import Block
from kvexec.segments import Segment

POLICIES = ("score", "random")


class RetentionPolicy:
    """What a store drops first: "score", the least attended segment (oldest first
    among equals), or "random", from a seeded generator a snapshot carries."""

    def __init__(self, name: str):
        if name not in POLICIES:
            raise ValueError(f"retention policy must be score or random, not {name!r}")
        self.name = name
        self.rng = random.Random(0)

    def choose(self, segments: list[Segment], first_movable: int) -> int | None:
        """The index in `segments` of the one to drop next among those starting at or
        after `first_movable` (past the pinned prompt and the sinks); None when none is
        left to drop."""
        movable = [i for i, s in enumerate(segments) if s.start >= first_movable]
        if not movable:
            return None
        if self.name == "random":
            return self.rng.choice(movable)
        return min(movable, key=lambda j: (segments[j].score, j))


def observe(block: Block, mass: float) -> None:
    """Credit a segment with the attention mass its block received (summed over heads
    and queries): the "score" policy drops the least attended."""
    if isinstance(block.tag, Segment):
        block.tag.score += mass

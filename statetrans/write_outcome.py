"""What became of one session state's write-through (statetrans/writer.py): the handle
a turn's entry keeps (statetrans/index.py) and whoever must know the turn is durable
waits on."""

from __future__ import annotations

import threading


class Write:
    """What became of one session state's write-through: `wait()` until it is decided,
    then `ok` (durable), `outcome` ("stored", "stored-as-fork" or "not-stored"),
    `stored_as` (the session name written: `session` itself, or a fork `session~k`),
    `generation`, `reason` (why not stored) and `evicted_recent` (recently used
    sessions the disk quota had to evict to make room)."""

    def __init__(self, session: str, scope: str = ""):
        self.session, self.scope = session, scope  # the name the turn asked for
        self.ok = False
        self.outcome = "pending"
        self.stored_as = ""
        self.generation = 0
        self.reason = ""
        self.evicted_recent = 0
        self.evicted: list[str] = []  # session folders the quota evicted after this write
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        """Whether the outcome is decided."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the outcome is decided (at most `timeout` seconds); whether it is."""
        return self._done.wait(timeout)

    def finish(self, outcome: str, stored_as: str = "", generation: int = 0, reason: str = "",
               evicted: list[tuple[str, bool]] = ()) -> None:
        """Decide the outcome and wake the waiters."""
        self.ok = outcome != "not-stored"
        self.outcome, self.stored_as, self.generation, self.reason = outcome, stored_as, generation, reason
        self.evicted = [f for f, _ in evicted]
        self.evicted_recent = sum(recent for _, recent in evicted)
        self._done.set()

    def __repr__(self) -> str:
        return (f"Write({self.session!r}, {self.outcome}, stored_as={self.stored_as!r}, "
                f"reason={self.reason!r}, evicted_recent={self.evicted_recent})")

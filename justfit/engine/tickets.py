"""Places in line kept across retries: a request turned away because the queue is full
gets a ticket (sent back in the 503 with Retry-After). A retry that shows it is queued
even past the queue's bound, ahead of every request that arrived after the ticket was
issued, and counts its wait from that first try. Clients that send no ticket are
served as before: a ticket never holds a place against them, so clients that ignore
tickets cannot starve anyone. Tickets are random strings looked up in this table only
(never a path or an index); each lapses when its client does not come back in time,
and at most MAX_TICKETS are held (the oldest lapse first)."""

from __future__ import annotations

import secrets

MAX_TICKETS = 256
# A 503 carries the ticket in this header; a retry sends it back in the same one.
TICKET_HEADER = "X-JustFit-Ticket"


class Tickets:
    """Outstanding tickets: when each was first issued and when it lapses (monotonic seconds)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[float, float]] = {}  # ticket -> (issued, lapses); insertion order = issue order

    def __len__(self) -> int:
        return len(self._held)

    def expire(self, now: float) -> None:
        """Forget the tickets whose time is up."""
        for t in [t for t, (_, lapses) in self._held.items() if lapses <= now]:
            del self._held[t]

    def hold(self, ticket: str | None, now: float, until: float) -> str:
        """`ticket` kept (lapsing at `until` now, its issue time unchanged) if
        outstanding, else a new one issued at `now`."""
        if ticket in self._held:
            self._held[ticket] = (self._held[ticket][0], until)
            return ticket
        while len(self._held) >= MAX_TICKETS:
            del self._held[next(iter(self._held))]
        ticket = secrets.token_urlsafe(12)
        self._held[ticket] = (now, until)
        return ticket

    def redeem(self, ticket: str | None) -> float | None:
        """Spend an outstanding ticket: when it was issued (None: no such ticket)."""
        held = self._held.pop(ticket, None) if ticket else None
        return None if held is None else held[0]

"""Which stored state a request starts from: the one of its scope sharing the longest
usable prefix with its tokens (its session's own first), and whether it stays indexed.
This module decides; the tiers (statetrans/tiers.py) detach the state chosen, trim it
to its prefix and hand it to the request to extend. Another scope's states are never
considered, so a request cannot reuse, read or even measure (`cached_tokens`) them."""

from __future__ import annotations

from typing import NamedTuple

from statetrans.index import Entry


class Candidate(NamedTuple):
    """A stored state a request may start from: `entry`, cut to its first `length`
    positions (`cut` dropped from its end), and whether it stays indexed (`keep`: a copy
    is handed out) or is handed over."""

    length: int
    entry: Entry
    keep: bool

    @property
    def cut(self) -> int:
        """Positions trimmed from the state's end."""
        return len(self.entry.tokens) - self.length


def ranked(matches: list[tuple[int, Entry]], tokens: int, own: str | None, session: str | None) -> list[Candidate]:
    """The states of `matches` ((shared prefix length, entry), of the request's scope) a
    request of `tokens` tokens may start from, best first: the longest prefix of at most
    all but the last token (so the request computes logits), then a state used whole,
    then the session's own (entry key `own`), then one in memory. A state that cannot be
    trimmed (recurrent layers) is usable only whole. A state extended as it is is handed
    over (the request's own state will cover it) unless it cannot be trimmed later or is
    another session's: those stay as checkpoints."""
    limit = tokens - 1
    candidates = [(min(n, limit), e) for n, e in matches]
    out = []
    for n, e in sorted(candidates, key=lambda c: (c[0], c[0] == len(c[1].tokens), c[1].key == own,
                                                  c[1].cache is not None), reverse=True):
        cut = len(e.tokens) - n
        if n <= 0 or (cut and not e.trimmable):
            continue
        keep = cut > 0 or not e.trimmable or (e.session is not None and e.session != session)
        out.append(Candidate(n, e, keep))
    return out

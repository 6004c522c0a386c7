"""Which stored state a request starts from: the one sharing the longest usable
prefix with its tokens (its session's own first), trimmed to that prefix and detached
from the tiers for the request to extend."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvexec.export import trim
from statetrans.memory_tier import Entry, Reuse
from statetrans.state import copy_cache

if TYPE_CHECKING:
    from statetrans.tiers import StateTiers


def take(tiers: StateTiers, tokens: list[int], session: str | None = None,
         memory_limit: int | None = None) -> Reuse:
    """The stored state sharing the longest usable prefix with `tokens` (at most
    all but the last token, so the request computes logits), trimmed to it, and
    detached for the request to extend. A state extended as it is leaves the index
    (the request's own state will cover it) unless it cannot be trimmed later
    (recurrent layers) or is another session's: those stay as checkpoints. The
    session's own state stays on disk until its next generation is durable."""
    if session:
        tiers.session_entry(session)  # also one another process wrote since
    limit = len(tokens) - 1
    own = tiers.index.sessions.get(session) if session else None
    candidates = [(min(n, limit), key) for n, key in tiers.index.trie.match(tokens)]
    entries = tiers.index.entries
    rank = {key: (n, n == len(entries[key].tokens), key == own, entries[key].cache is not None)
            for n, key in candidates}
    for key in sorted(rank, key=lambda k: rank[k], reverse=True):
        n, e = rank[key][0], entries.get(key)
        if e is None:
            continue
        cut = len(e.tokens) - n
        if n <= 0 or (cut and not e.trimmable):
            continue
        keep = cut > 0 or not e.trimmable or (e.session is not None and e.session != session)
        reuse = _detach(tiers, e, keep, memory_limit)
        if reuse is None:
            continue
        if cut and not trim(reuse.cache, cut):
            continue  # e.g. evicted positions: the copy is dropped
        reuse.tokens = reuse.tokens[:n]
        return reuse
    tiers.fit(memory_limit)
    return Reuse(None, [], {}, "")


def _detach(tiers: StateTiers, e: Entry, keep: bool, memory_limit: int | None) -> Reuse | None:
    """`e`'s state for a request: handed over, or a copy where `keep` (or a
    session's) leaves it indexed; None when it cannot be read from disk."""
    start = time.perf_counter()
    stays = keep or e.session is not None  # a session's next turn: its disk copy stays indexed
    if not keep and e.cache is not None:  # hand the memory over; nothing to copy
        cache, source = e.cache, "memory"
        e.cache = None
        tiers.release(e, stays)
        tiers.fit(memory_limit)
    else:
        tiers.fit(memory_limit, spare=None if keep else e)  # spill first: the copy needs room
        if e.cache is not None:
            cache, source = copy_cache(e.cache), "memory"
        else:
            cache, source = tiers.load(e), "disk"
            if cache is None:
                return None
            tiers.restored += 1
        tiers.release(e, stays)
    return Reuse(cache, list(e.tokens), dict(e.sampler), source, time.perf_counter() - start, e.session)

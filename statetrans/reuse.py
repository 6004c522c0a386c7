"""Which stored state a request starts from: the one of its scope sharing the longest
usable prefix with its tokens (its session's own first), trimmed to that prefix and
detached from the tiers for the request to extend. Another scope's states are never
considered, so a request cannot reuse, read or even measure (`cached_tokens`) them."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvexec.export import trim
from statetrans.memory_tier import Entry, Reuse
from statetrans.quarantine import quarantine
from statetrans.state import copy_cache

log = logging.getLogger("justfit.statetrans")

if TYPE_CHECKING:
    from statetrans.tiers import StateTiers


def take(tiers: StateTiers, tokens: list[int], session: str | None = None,
         memory_limit: int | None = None, scope: str = "") -> Reuse:
    """The stored state of `scope` sharing the longest usable prefix with `tokens` (at
    most all but the last token, so the request computes logits), trimmed to it, and
    detached for the request to extend. A state extended as it is leaves the index
    (the request's own state will cover it) unless it cannot be trimmed later
    (recurrent layers) or is another session's: those stay as checkpoints. The
    session's own state stays on disk until its next generation is durable.
    `Reuse.base` is `session`'s generation as found (0: none), whatever state the
    request starts from: its `put` keeps a fork if the session moves on meanwhile."""
    base, own = 0, None
    if session:
        current = tiers.session_entry(session, scope)  # also one another process wrote since
        if current is not None:
            base, own = current.generation, current.key
            tiers.touch_session(current)
    limit = len(tokens) - 1
    candidates = [(min(n, limit), e) for n, e in tiers.index.match(tokens, scope)]
    ranked = sorted(candidates, key=lambda c: (c[0], c[0] == len(c[1].tokens), c[1].key == own,
                                                c[1].cache is not None), reverse=True)
    for n, e in ranked:
        if e.key not in tiers.index.entries or e.scope != scope:
            continue
        cut = len(e.tokens) - n
        if n <= 0 or (cut and not e.trimmable):
            continue
        keep = cut > 0 or not e.trimmable or (e.session is not None and e.session != session)
        try:
            reuse = _detach(tiers, e, keep, memory_limit)
            if reuse is None or (cut and not trim(reuse.cache, cut)):
                continue  # unreadable, or e.g. evicted positions: the copy is dropped
        except Exception as err:  # noqa: BLE001 - a stored state never fails a request: the next one, or none
            log.warning("not reusing a stored state of %d tokens: %r", len(e.tokens), err, exc_info=True)
            continue
        reuse.tokens, reuse.base = reuse.tokens[:n], base
        return reuse
    tiers.fit(memory_limit)
    return Reuse(None, [], {}, "", base=base)


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
            source = "disk"
            try:
                cache = tiers.load(e)
            except Exception as err:  # noqa: BLE001 - whatever a stored file does, the request goes on
                log.warning("not reusing a stored state of %d tokens: %r", len(e.tokens), err, exc_info=True)
                tiers.index.remove(e)  # (a session's older generation is found again on its next request)
                if e.path is not None and not isinstance(err, MemoryError):  # too large now is not damage
                    quarantine(tiers.dir, e.path, err)
                return None
            if cache is None:
                return None
            tiers.restored += 1
        tiers.release(e, stays)
    return Reuse(cache, list(e.tokens), dict(e.sampler), source, time.perf_counter() - start, e.session)

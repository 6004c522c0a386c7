"""Where a sequence's state comes from and goes to, chosen by the engine's runner
(justfit.engine.runner): one process's stored states (`StoredStates`: statetrans, shared
by every request), or the state every rank of a layer pipeline keeps
(justfit.engine.pipeline_runner.PipelineStates). Everything else a request does is the
same Sequence through the same scheduler."""

from __future__ import annotations

from typing import Protocol

from justfit.planning.cost_model import Footprint
from statetrans import Reuse


class StateSource(Protocol):
    """What a sequence resumes from and leaves its state in."""

    def take(self, tokens: list[int], session: str | None, allowance: int | None, scope: str) -> Reuse:
        """The state sharing the longest prefix with `tokens` (the memory tier held to
        `allowance`), detached for the sequence to extend."""

    def put(self, tokens: list[int], cache: list, session: str | None, rng: dict, scope: str, base: int):
        """Keep `cache`, holding exactly `tokens`; a named session's write (or None)."""

    def page_room(self, plan: Footprint, budget: int | None) -> int | None:
        """The bytes the sequence's resident pages may take (None: no limit)."""

    def failure(self, error: Exception) -> Exception:
        """What a failed step tells its requests (`error`, or what it means here)."""


class StoredStates:
    """One process's stored states (engine.states): each sequence's pages keep to its
    own plan, as the batch was admitted on the sum of the plans."""

    def __init__(self, engine):
        self.engine = engine

    def take(self, tokens: list[int], session: str | None, allowance: int | None, scope: str) -> Reuse:
        """The stored state of `scope` sharing the longest prefix (statetrans.StateTiers.take)."""
        return self.engine.states.take(tokens, session, allowance, scope=scope)

    def put(self, tokens: list[int], cache: list, session: str | None, rng: dict, scope: str, base: int):
        """Kept in the stored states; a named session's write-through."""
        stored = self.engine.states.put(tokens, cache, session, rng, scope=scope, base=base)
        return stored.write if session else None

    def page_room(self, plan: Footprint, budget: int | None) -> int | None:
        """Its own plan's pages: the batch was admitted on the sum of the plans."""
        return None if budget is None else plan.page_allowance(plan.total)

    def failure(self, error: Exception) -> Exception:
        """The error itself."""
        return error

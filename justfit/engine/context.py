"""What the request path reads from an engine, as a typing protocol.

The step loop (justfit.engine.scheduler, justfit.engine.sequence), the planner's search (justfit.planning.budget)
and the runners (justfit.engine.runner) take an `EngineContext`, not the engine class: justfit.engine.facade
imports them, so they never import it back (no import circle), and a test may pass
any object with these members. `justfit.engine.facade.Engine` is the one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.nn as nn

from justfit.config import EngineConfig
from justfit.engine.numerics import Numerics
from justfit.memory import MemoryReport, peak_rss_bytes
from justfit.planning.outside import Budget
from justfit.planning.planner import Footprint
from justfit.engine.speculate import StepCosts
from phaseswap import PhaseSwap
from statetrans import StateTiers


class EngineContext(Protocol):
    """The loaded model, its settings, PhaseSwap, the stored states and the planner."""

    model: nn.Module
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: EngineConfig
    swap: PhaseSwap
    states: StateTiers
    context_limit: int
    rank_limits: list[int]  # the positions each rank's plan holds, from the runner ([] for one process)
    step_costs: StepCosts  # decode steps' measured seconds by rows (what a draft must beat)
    budget: Budget  # the budget now (justfit.planning.outside: a whole-process one's share changes)
    numerics: Numerics  # how every token is computed: whether replies depend on the path

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim)."""

    @property
    def verify_rows(self) -> int:
        """The most positions a decode step feeds (1, and a draft's tokens when drafting)."""

    def new_cache(self) -> list:
        """Per-layer state for one sequence."""

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> tuple[tuple[str, ...], Footprint]:
        """Refuse what cannot fit, before any work; else the components on disk and the plan."""

    def footprint(self, positions: int, offloaded: tuple[str, ...] = (), kv: Any = "engine", chunk: int | None = None,
                  pressed: bool = False, dense_prefill: bool = True, disk_layers: int = 0,
                  verify_rows: int | None = None) -> Footprint:
        """Memory for `positions` retained positions planned this way."""

    def state_allowance(self, request: Footprint) -> int | None:
        """What the budget leaves for stored states while `request` runs."""

    def remeasure_outside(self, high_water: int = 0, mlx_peak: int = 0, seen: int = 0) -> None:
        """Under a whole-process budget, take what the process holds besides MLX off the engine's share."""

    def remeasure_reserve(self, plan: Footprint, positions: int, mlx_peak: int, states: int = 0,
                          besides: int = 0) -> None:
        """Under a budget, measure the planner's reserve again from a request's MLX peak against its plan."""

    def mlx_besides(self) -> int:
        """MLX's active bytes besides the engine's resident weights and stored states."""

    def watch_outside(self) -> Any:
        """A started OutsideWatch while requests run (None without a whole-process budget)."""


@dataclass(frozen=True)
class RequestMeasure:
    """What a request is measured by for the budget, taken as it begins
    (`measure_request`); `done` when it ends measures the outside share and the
    planner's reserve again."""

    engine: EngineContext
    high_water: int  # the process's high-water mark before the request
    besides: int  # MLX's bytes that were not the engine's (EngineContext.mlx_besides)
    watch: Any  # an OutsideWatch while it runs, or None

    def done(self, plan: Footprint, positions: int, memory: MemoryReport | None) -> None:
        """After the request planned as `plan`, which reached `positions` and reported
        `memory` (None: it failed before any)."""
        mlx_peak = memory.mlx_peak if memory is not None else 0
        seen = self.watch.stop() if self.watch is not None else 0
        self.engine.remeasure_outside(high_water=self.high_water, mlx_peak=mlx_peak, seen=seen)
        if memory is not None:  # the planner's reserve: what MLX peaked at against the plan at the length reached
            self.engine.remeasure_reserve(plan, positions, mlx_peak, memory.states, self.besides)


def measure_request(engine: EngineContext) -> RequestMeasure:
    """Start measuring a request on `engine` (call before it allocates anything)."""
    return RequestMeasure(engine, peak_rss_bytes(), engine.mlx_besides(), engine.watch_outside())

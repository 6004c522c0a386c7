"""The planner: fits a request into the engine's budget (which components go to disk,
whether pages step down the pressure ladder, how large a prefill chunk) or refuses it
before any work. `Planner` is built once at load from the parts it reads (the model's
shapes, the settings, the budget, PhaseSwap, the numerics' flags); the cost model it
sizes plans with is justfit.planning.cost_model."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

import kvexec
from justfit.config import EngineConfig
from justfit.errors import BudgetExceeded, ContextTooLong, KVDiskFull
from justfit.memory import MemoryReport, peak_rss_bytes
from justfit.planning.budget import Budget, OutsideWatch
from justfit.planning.cost_model import MIN_PREFILL_CHUNK, PAGE_MARGIN, Footprint, attention_shape, footprint
from kvexec import KVConfig
from phaseswap import PhaseSwap
from statetrans import StateTiers



def prefill_ways(chunk: int, budget: int | None, one_row: bool, deterministic: bool) -> Iterator[tuple[int, bool]]:
    """(prefill chunk, on dense working copies) to try, cheapest first: a smaller chunk
    shrinks the transient (scores, activations) at little cost; at the smallest, prefill
    on the resident forms (no dense copy; their products may dequantize two weights side
    by side where a dense lease holds one, so the planner takes whichever fits first).
    Both come before offloading layers.
    Deterministic numerics prefill on the decode (resident) forms only; one row at a
    time, in chunks of one."""
    if one_row:
        yield 1, False
        return
    dense = not deterministic
    yield chunk, dense
    while budget is not None and chunk > MIN_PREFILL_CHUNK:
        chunk = max(MIN_PREFILL_CHUNK, chunk // 2)
        yield chunk, dense
    if budget is not None and dense:
        yield chunk, False


@dataclass(frozen=True)
class Costs:
    """The cost model (justfit.planning.cost_model) bound to one loaded model and its
    settings: what the engine's load check and its planner size footprints with."""

    model: nn.Module  # read for its shapes only
    model_config: dict
    config: EngineConfig  # the engine's (its KV format adapted to the model)
    act_bytes: int  # the activations' width: 4 under a float32 policy, else 2
    budget: Budget

    def footprint(self, positions: int, weights: int | None, working: int, verify_rows: int,
                  kv: KVConfig | None | str = "engine", chunk: int | None = None, pressed: bool = False,
                  dense_prefill: bool = True, disk_layers: int = 0) -> Footprint:
        """`positions` retained positions with `weights` resident and `working` leased
        (see `Planner.footprint`); `kv` "engine": the engine's KV format."""
        c = self.config
        return footprint(self.model, self.model_config, positions, chunk or c.prefill_chunk,
                         c.kv if kv == "engine" else kv, weights, working, self.act_bytes, pressed, dense_prefill,
                         limited=self.budget.bytes is not None, disk_layers=disk_layers, verify_rows=verify_rows,
                         row_invariant=c.deterministic, reserve=self.budget.reserve)


@dataclass(frozen=True)
class Planner:
    """What a request needs and how it fits the budget now: footprints over the loaded
    weights, the plan search, the check before any work, what is left for stored states.
    Built once at load; the budget's measured values change inside `costs.budget`."""

    costs: Costs
    swap: PhaseSwap  # the weights' components, what may go to disk, the working copies
    states: StateTiers  # the stored states (in MLX's peaks, not a request's)
    one_row: bool  # the numerics feed one row at a time (justfit.engine.numerics)
    deterministic: bool  # the numerics prefill on the decode forms only
    context_limit: int
    max_draft: int  # drafted tokens a verify step may feed besides the last one (0: no drafts)
    rank_limits: tuple[int, ...] = ()  # the positions each rank's own plan holds; () for one process

    @property
    def config(self) -> EngineConfig:
        """The engine's settings the plans follow."""
        return self.costs.config

    @property
    def budget(self) -> Budget:
        """The budget now (its measured share and reserve change inside it)."""
        return self.costs.budget

    @property
    def verify_rows(self) -> int:
        """The most positions a decode step feeds: 1, and a draft's tokens when drafting."""
        return 1 + self.max_draft if self.config.draft == "ngram" and not self.one_row else 1

    @property
    def head_dim(self) -> int:
        """The attention heads' width (which KV formats, and ladder steps, apply)."""
        return attention_shape(self.costs.model, self.costs.model_config)[2]

    def footprint(self, positions: int, offloaded: tuple[str, ...] = (),
                  kv: KVConfig | None | str = "engine", chunk: int | None = None,
                  pressed: bool = False, dense_prefill: bool = True, disk_layers: int = 0,
                  verify_rows: int | None = None) -> Footprint:
        """Memory for `positions` retained positions with `offloaded` components on disk,
        prefilled `chunk` tokens at a time (default: the configured chunk); `kv`
        another KV configuration (None: mlx-lm's own cache) for comparisons; `pressed`:
        with pages stepped down to the last format of the pressure ladder;
        `dense_prefill` False: prefill on the resident forms, no dense working copy;
        `disk_layers`: growing layers whose pages live on disk; `verify_rows`: the most
        positions a decode step feeds (None: `verify_rows`)."""
        reg = self.swap.registry
        weights = reg.total_bytes() - sum(reg.components[n].nbytes for n in offloaded)
        return self.costs.footprint(positions, weights, self.swap.working_bytes(offloaded, dense_prefill),
                                    self.verify_rows if verify_rows is None else verify_rows, kv, chunk, pressed,
                                    dense_prefill, disk_layers)

    def edge_footprint(self, offloaded: tuple[str, ...] = (), kv: KVConfig | None | str = "engine",
                       pressed: bool = False, disk_layers: int = 0) -> Footprint:
        """`footprint` at one position, prefilled the cheapest way a tight budget's plan
        takes (the smallest chunk, on the resident forms or one dense linear at a time,
        whichever holds less; no drafts: `plan`): what a budget holds is its `max_positions`."""
        dense = (False, True) if not (self.deterministic or self.one_row) else (False,)
        return min((self.footprint(1, offloaded, kv, MIN_PREFILL_CHUNK, pressed, dense_prefill=d,
                                   disk_layers=disk_layers, verify_rows=1) for d in dense),
                   key=lambda fp: fp.total)

    def state_allowance(self, request: Footprint) -> int | None:
        """What the budget leaves for stored states while `request` runs."""
        budget = self.budget.bytes
        return None if budget is None else max(0, budget - request.total)

    def mlx_besides(self) -> int:
        """MLX's active bytes besides the engine's resident weights and stored states
        (another engine's, arrays a caller holds): not the engine's, though in its MLX peaks."""
        return max(0, mx.get_active_memory() - self.swap.registry.resident_bytes() - self.states.memory_bytes)

    def _moves(self, positions: int) -> list[str | None]:
        """What the plan may move to disk, in the order it does: weight components (their
        names) and growing layers' pages (None, one layer each). Either costs one byte read
        per byte of memory it frees, per token decoded and per prefill chunk, so the larger
        unit goes first: fewer reads for the same room. Pages move only with a KV folder."""
        weights = self.swap.offload_order() if self.config.offload_weights else []
        sizes = [(self.swap.registry.components[n].nbytes, n) for n in weights]
        kv = self.config.kv
        if self.config.kv_disk is not None and kv is not None and self.config.kv_disk_layers is None:
            fp = self.footprint(positions)
            layer = (fp.pages + fp.disk) / max(1, fp.shape.full_layers - fp.shape.disk_layers)
            sizes += [(layer, None)] * fp.shape.full_layers
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][0], i))  # stable: weights keep their order
        return [sizes[i][1] for i in order]

    def plan(self, positions: int) -> tuple[tuple[str, ...], Footprint]:
        """The fewest moves to disk (weight components, growing layers' pages: `_moves`),
        then pages kept in their format rather than stepped down the pressure ladder, then
        the largest prefill chunk (and dense prefill over resident), then drafted tokens
        verified in a decode step, so `positions` fit the budget; and the footprint so
        (`shape.chunk` is the chunk, `shape.dense_prefill` the prefill forms,
        `shape.verify_rows` 1 when drafts do not fit, `shape.disk_layers` the layers whose pages are on disk,
        `page_allowance` what the resident pages may take). With pages allowed on disk,
        every layer's pages go there before any page steps down the ladder (the ladder loses
        fidelity, disk only speed). The last tried, when nothing fits."""
        budget = self.budget.bytes
        moves = self._moves(positions) if budget is not None else []
        kv = self.config.kv
        # (pressed, the most the footprint may take): with the ladder to fall back on, wide
        # pages keep a margin from the budget's edge (as the ladder's own page limit does).
        tries: list[tuple[bool, float | None]] = [(False, budget)]
        if budget is not None and kv is not None and len(kvexec.ladder(kv, self.head_dim)) > 1:
            tries = [(False, budget * (1 - PAGE_MARGIN)), (True, budget)]
        passes = [(tries, range(len(moves) + 1))]
        if None in moves and len(tries) > 1:  # disk before the ladder: the ladder only once all is moved
            passes = [(tries[:1], range(len(moves) + 1)), (tries[1:], [len(moves)])]
        forced = self.config.kv_disk_layers if self.config.kv_disk is not None and kv is not None else None
        for allowed, ks in passes:
            for k in ks:
                offloaded = tuple(m for m in moves[:k] if m is not None)
                disk_layers = k - len(offloaded) if forced is None else forced
                for pressed, edge in allowed:
                    for chunk, dense in prefill_ways(self.config.prefill_chunk, budget, self.one_row,
                                                     self.deterministic):
                        # Drafts go first: a verify step's rows are a small transient, worth less than any other way.
                        for rows in sorted({self.verify_rows, 1}, reverse=True):
                            fp = self.footprint(positions, offloaded, chunk=chunk, pressed=pressed,
                                                dense_prefill=dense, disk_layers=disk_layers, verify_rows=rows)
                            if edge is None or fp.total <= edge:
                                return offloaded, fp
        return tuple(m for m in moves if m is not None), fp

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> tuple[tuple[str, ...], Footprint]:
        """Refuse, before any work, what the context or the budget cannot hold; return the
        plan it fits with (see `plan`)."""
        if prompt_tokens + max_tokens > self.context_limit:
            raise ContextTooLong(prompt_tokens, max_tokens, self.context_limit)
        kv = self.config.kv
        retain = kv.max_positions if kv is not None and kv.pin_prompt else None
        if retain is not None and prompt_tokens > retain:  # the prompt is pinned: never evicted
            raise ContextTooLong(prompt_tokens, 0, retain, "positions the KV retention budget keeps")
        positions = prompt_tokens + max_tokens
        # Extra limits, as data: the positions each other rank's own plan holds (the engine's
        # runner gathered them at load; none for one process). Rank 0's is checked below, with its plan.
        others = [(n, r) for r, n in enumerate(self.rank_limits) if r and 0 <= n < positions]
        if others:
            n, r = min(others)
            raise ContextTooLong(prompt_tokens, max_tokens, n, f"positions rank {r} of the layer pipeline holds in its "
                                 f"budget (per rank: {list(self.rank_limits)})")
        offloaded, fp = self.plan(positions)
        budget = self.budget.bytes
        if budget is not None and fp.total > budget:
            self.budget.remeasure()  # a refused request counts too: a spike must not refuse all for good
            raise BudgetExceeded(fp.total, budget, fp.max_positions(budget), positions)
        if fp.disk:
            room = kv_disk_room(self.config.kv_disk, self.config.kv_disk_limit)
            if fp.disk > room:
                raise KVDiskFull(fp.disk, room, positions, self.config.kv_disk)
        return offloaded, fp


def kv_disk_room(folder: str, limit: int | None) -> int:
    """Bytes of pages a request may keep in `folder`: `limit`, never more than the free
    space there less a tenth of the disk (None: half the free space)."""
    os.makedirs(folder, exist_ok=True)
    usage = shutil.disk_usage(folder)
    free = max(0, usage.free - usage.total // 10)
    return min(free, limit) if limit is not None else free // 2


@dataclass(frozen=True)
class RequestMeasure:
    """What a request is measured by for the budget, taken as it begins
    (`measure_request`); `done` when it ends measures the outside share and the
    planner's reserve again."""

    budget: Budget
    high_water: int  # the process's high-water mark before the request
    besides: int  # MLX's bytes that were not the engine's (Planner.mlx_besides)
    watch: OutsideWatch | None  # while it runs, under a whole-process budget

    def done(self, plan: Footprint, positions: int, memory: MemoryReport | None) -> None:
        """After the request planned as `plan`, which reached `positions` and reported
        `memory` (None: it failed before any)."""
        mlx_peak = memory.mlx_peak if memory is not None else 0
        seen = self.watch.stop() if self.watch is not None else 0
        self.budget.remeasure(high_water=self.high_water, mlx_peak=mlx_peak, seen=seen)
        if memory is not None and positions > 0:  # the reserve: MLX's peak against the plan at the length reached
            self.budget.remeasure_reserve(plan.at(positions), mlx_peak, memory.states, self.besides)


def measure_request(planner: Planner) -> RequestMeasure:
    """Start measuring a request planned by `planner` (call before it allocates anything)."""
    return RequestMeasure(planner.budget, peak_rss_bytes(), planner.mlx_besides(), planner.budget.watch())

"""The budget accountant: the plan search that fits a request into the engine's budget (which components go to disk,
whether pages step down the pressure ladder, how large a prefill chunk) or refuses it
before any work."""

from __future__ import annotations

import os
import shutil
from typing import Iterator

import kvexec
from justfit.engine.context import EngineContext
from justfit.errors import BudgetExceeded, ContextTooLong, KVDiskFull
from justfit.engine.numerics import Numerics
from justfit.planning.planner import MIN_PREFILL_CHUNK, PAGE_MARGIN, Footprint



def prefill_ways(chunk: int, budget: int | None, numerics: Numerics) -> Iterator[tuple[int, bool]]:
    """(prefill chunk, on dense working copies) to try, cheapest first: a smaller chunk
    shrinks the transient (scores, activations) at little cost; at the smallest, prefill
    on the resident forms (no dense copy; their products may dequantize two weights side
    by side where a dense lease holds one, so the planner takes whichever fits first).
    Both come before offloading layers.
    Deterministic numerics prefill on the decode (resident) forms only; one row at a
    time, in chunks of one."""
    if numerics.one_row:
        yield 1, False
        return
    dense = not numerics.deterministic
    yield chunk, dense
    while budget is not None and chunk > MIN_PREFILL_CHUNK:
        chunk = max(MIN_PREFILL_CHUNK, chunk // 2)
        yield chunk, dense
    if budget is not None and dense:
        yield chunk, False


def _moves(engine: EngineContext, positions: int) -> list[str | None]:
    """What the plan may move to disk, in the order it does: weight components (their
    names) and growing layers' pages (None, one layer each). Either costs one byte read
    per byte of memory it frees, per token decoded and per prefill chunk, so the larger
    unit goes first: fewer reads for the same room. Pages move only with a KV folder."""
    weights = engine.swap.offload_order() if engine.config.offload_weights else []
    sizes = [(engine.swap.registry.components[n].nbytes, n) for n in weights]
    kv = engine.config.kv
    if engine.config.kv_disk is not None and kv is not None and engine.config.kv_disk_layers is None:
        fp = engine.footprint(positions)
        layer = (fp.pages + fp.disk) / max(1, fp.shape.full_layers - fp.shape.disk_layers)
        sizes += [(layer, None)] * fp.shape.full_layers
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][0], i))  # stable: weights keep their order
    return [sizes[i][1] for i in order]


def plan(engine: EngineContext, positions: int) -> tuple[tuple[str, ...], Footprint]:
    """The fewest moves to disk (weight components, growing layers' pages: `_moves`),
    then pages kept in their format rather than stepped down the pressure ladder, then
    the largest prefill chunk (and dense prefill over resident), then drafted tokens
    verified in a decode step, so `positions` fit the budget; and the footprint so
    (`shape.chunk` is the chunk, `shape.dense_prefill` the prefill forms,
    `shape.verify_rows` 1 when drafts do not fit, `shape.disk_layers` the layers whose pages are on disk,
    `page_allowance` what the resident pages may take). With pages allowed on disk,
    every layer's pages go there before any page steps down the ladder (the ladder loses
    fidelity, disk only speed). The last tried, when nothing fits."""
    budget = engine.budget.bytes
    moves = _moves(engine, positions) if budget is not None else []
    kv = engine.config.kv
    # (pressed, the most the footprint may take): with the ladder to fall back on, wide
    # pages keep a margin from the budget's edge (as the ladder's own page limit does).
    tries: list[tuple[bool, float | None]] = [(False, budget)]
    if budget is not None and kv is not None and len(kvexec.ladder(kv, engine.kv_shape[2])) > 1:
        tries = [(False, budget * (1 - PAGE_MARGIN)), (True, budget)]
    passes = [(tries, range(len(moves) + 1))]
    if None in moves and len(tries) > 1:  # disk before the ladder: the ladder only once all is moved
        passes = [(tries[:1], range(len(moves) + 1)), (tries[1:], [len(moves)])]
    forced = engine.config.kv_disk_layers if engine.config.kv_disk is not None and kv is not None else None
    for allowed, ks in passes:
        for k in ks:
            offloaded = tuple(m for m in moves[:k] if m is not None)
            disk_layers = k - len(offloaded) if forced is None else forced
            for pressed, edge in allowed:
                for chunk, dense in prefill_ways(engine.config.prefill_chunk, budget, engine.numerics):
                    # Drafts go first: a verify step's rows are a small transient, worth less than any other way.
                    for rows in sorted({engine.verify_rows, 1}, reverse=True):
                        fp = engine.footprint(positions, offloaded, chunk=chunk, pressed=pressed, dense_prefill=dense,
                                              disk_layers=disk_layers, verify_rows=rows)
                        if edge is None or fp.total <= edge:
                            return offloaded, fp
    return tuple(m for m in moves if m is not None), fp


def check_fits(engine: EngineContext, prompt_tokens: int, max_tokens: int) -> tuple[tuple[str, ...], Footprint]:
    """Refuse, before any work, what the context or the budget cannot hold; return the
    plan it fits with (see `plan`)."""
    if prompt_tokens + max_tokens > engine.context_limit:
        raise ContextTooLong(prompt_tokens, max_tokens, engine.context_limit)
    kv = engine.config.kv
    retain = kv.max_positions if kv is not None and kv.pin_prompt else None
    if retain is not None and prompt_tokens > retain:  # the prompt is pinned: never evicted
        raise ContextTooLong(prompt_tokens, 0, retain, "positions the KV retention budget keeps")
    positions = prompt_tokens + max_tokens
    # Extra limits, as data: the positions each other rank's own plan holds (the engine's
    # runner gathered them at load; none for one process). Rank 0's is checked below, with its plan.
    others = [(n, r) for r, n in enumerate(engine.rank_limits) if r and 0 <= n < positions]
    if others:
        n, r = min(others)
        raise ContextTooLong(prompt_tokens, max_tokens, n, f"positions rank {r} of the layer pipeline holds in its "
                             f"budget (per rank: {engine.rank_limits})")
    offloaded, fp = plan(engine, positions)
    budget = engine.budget.bytes
    if budget is not None and fp.total > budget:
        engine.remeasure_outside()  # a refused request counts too: a spike must not refuse all for good
        raise BudgetExceeded(fp.total, budget, fp.max_positions(budget), positions)
    if fp.disk:
        room = kv_disk_room(engine.config.kv_disk, engine.config.kv_disk_limit)
        if fp.disk > room:
            raise KVDiskFull(fp.disk, room, positions, engine.config.kv_disk)
    return offloaded, fp


def kv_disk_room(folder: str, limit: int | None) -> int:
    """Bytes of pages a request may keep in `folder`: `limit`, never more than the free
    space there less a tenth of the disk (None: half the free space)."""
    os.makedirs(folder, exist_ok=True)
    usage = shutil.disk_usage(folder)
    free = max(0, usage.free - usage.total // 10)
    return min(free, limit) if limit is not None else free // 2

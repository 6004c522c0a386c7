"""Stock float16 rows that cannot reach their budget in their time: a memory model
fitted to short measured steps, then stated at the sweep's own step (the chunk
transient a user's prompt of that size meets), and checked on a system that is fast
enough to run both ways (mlx-lm-fp32: the same model code, reference BLAS)."""

from __future__ import annotations

from dataclasses import replace


def _terms(stock, shape: dict, chunk: int) -> tuple[float, float]:
    from bench.memmodel import SCORE_BYTES, transient_terms

    itemsize = 4 if stock.dtype == "float32" else 2
    return transient_terms(shape["heads"], shape["hidden"], shape["intermediate"], shape["vocab"], chunk,
                           itemsize, SCORE_BYTES.get((stock.dtype, stock.kv_bits)))


def stock_model(system: str, run: dict, measured_step: int, step: int):
    """The memory model of `system` fitted to `run`'s points (steps of `measured_step`
    tokens), its chunk transient restated for steps of `step` tokens."""
    from bench.memmodel import fit, kv_bytes_per_position
    from bench.stock import STOCK

    setup, shape = run["setup"], run["setup"]["shape"]
    stock = STOCK[system]
    kv = kv_bytes_per_position(shape["full_layers"], shape["kv_heads_x_head_dim"], 1,
                               4 if stock.dtype == "float32" else 2, stock.kv_bits, stock.kv_group_size)
    measured = _terms(stock, shape, min(stock.prefill_step, measured_step))
    model = fit([(s["positions"], s["peak_rss"]) for s in run["steps"]], setup["baseline_rss"],
                setup["weights_bytes"], kv, measured)
    at = _terms(stock, shape, min(stock.prefill_step, step))
    # a fitted per-position transient scales with the chunk, as the planner's term does
    per = model.transient_per_position * at[0] / measured[0] if measured[0] else at[0]
    return replace(model, transient_per_position=per, transient_fixed=at[1])


def model_row(row: dict, run: dict, budget: int, measured_step: int, step: int) -> None:
    """A stock run stopped by its clock before `budget`: the row gains its modeled
    capacity there (only where above what it measured)."""
    model = stock_model(row["system"], run, measured_step, step)
    modeled = model.capacity(budget)
    if modeled > row["positions"]:
        row.update(modeled_positions=modeled, modeled=True, memory_model=model.as_dict(),
                   modeled_step_tokens=step, measured_step_tokens=measured_step)


def check(system: str, short: dict, full: dict, measured_step: int, step: int, budgets: list[int]) -> dict:
    """The modeling checked where both can be measured: the model fitted to `short`
    (steps of `measured_step`) predicts `full`'s peaks (steps of `step`) and the
    capacity at each budget."""
    model = stock_model(system, short, measured_step, step)
    points = [{"positions": s["positions"], "measured_mib": round(s["peak_rss"] / 2**20, 1),
               "modeled_mib": round(model.peak(s["positions"]) / 2**20, 1)} for s in full["steps"]]
    for p in points:
        p["error_mib"] = round(p["modeled_mib"] - p["measured_mib"], 1)
    capacities = []
    for budget in budgets:
        within = [s["positions"] for s in full["steps"] if s["peak_rss"] <= budget]
        passed = len(within) < len(full["steps"])
        capacities.append({"budget_mib": round(budget / 2**20, 1), "modeled": model.capacity(budget),
                           "measured": within[-1] if within else 0,
                           "measured_is": "exact edge within a step" if passed else "at least (the run ended first)"})
    return {"system": system, "measured_step_tokens": measured_step, "step_tokens": step,
            "memory_model": model.as_dict(), "points": points, "capacities": capacities,
            "max_error_mib": max((abs(p["error_mib"]) for p in points), default=None)}

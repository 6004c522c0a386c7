"""Rows that cannot reach their budget in their time: a memory model fitted to the
run's measured steps. Stock float16 runs are measured in short steps and stated at the
sweep's own step (the chunk transient a user's prompt of that size meets), checked on a
system fast enough to run both ways (mlx-lm-fp32: the same model code, reference
BLAS). JustFit runs (attention over pages: the transient does not grow with the
positions) take their page bytes per position from the planner's own accounting,
checked on runs that reached their budget (`check_justfit`)."""

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


def justfit_model(run: dict, steps: int = 0):
    """JustFit's memory model from its run's first `steps` steps (0: all): baseline +
    page bytes per position + a fitted constant (its flat transients, the allocator).
    The page bytes are the slope of the planner's planned peak over the steps at the
    last step's prefill chunk, so only what the planner accounts per position grows."""
    from bench.memmodel import fit

    taken = run["steps"][:steps or None]
    chunk = taken[-1].get("prefill_chunk")
    same = [s for s in taken if s.get("prefill_chunk") == chunk]
    if len(same) < 2:
        raise ValueError("a JustFit memory model needs two steps at one prefill chunk")
    kv = (same[-1]["planned"] - same[0]["planned"]) / (same[-1]["positions"] - same[0]["positions"])
    if kv <= 0:  # e.g. retention: what it holds does not grow with the positions fed
        raise ValueError("the planned peak does not grow with the positions: no capacity to model")
    setup = run["setup"]
    return fit([(s["positions"], s["peak_rss"]) for s in same], setup["baseline_rss"],
               setup.get("weights_bytes", 0), kv, (0.0, 0.0))


def memory_model(system: str, run: dict, measured_step: int, step: int):
    """The system's memory model fitted to `run` (see the module's docstring)."""
    if system.startswith("justfit"):
        return justfit_model(run)
    return stock_model(system, run, measured_step, step)


def model_row(row: dict, run: dict, budget: int, measured_step: int, step: int) -> None:
    """A run stopped by its clock before `budget`: the row gains its modeled capacity
    there (only where above what it measured)."""
    try:
        model = memory_model(row["system"], run, measured_step, step)
    except ValueError:
        return  # too few steps to fit: the measured lower bound stands alone
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


def check_justfit(run: dict, budget: int, steps: int) -> dict:
    """JustFit's modeling checked on a run that reached `budget`: the model fitted to
    its first `steps` steps, its capacity against the measured edge."""
    model = justfit_model(run, steps)
    within = [s["positions"] for s in run["steps"] if s["peak_rss"] <= budget]
    return {"fitted_steps": steps, "fitted_up_to": run["steps"][steps - 1]["positions"],
            "budget_mib": round(budget / 2**20, 1), "modeled": model.capacity(budget),
            "measured": within[-1] if within else 0, "memory_model": model.as_dict()}

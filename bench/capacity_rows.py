"""A capacity run's row at one budget (bench.capacity, bench.capacity_llama): its
last step within the budget, and a memory model's capacity where the run's clock
stopped it first (bench.capacity_model)."""

from __future__ import annotations

from bench.capacity_model import model_row

MIB = 2**20


def row_at(system: str, args, budget: int, run: dict, measured_step: int = 0) -> dict:
    """The capacity row a run gives at `budget`: its last step within the budget (a
    run stopped by its clock also gets its memory model's capacity, a stock one's
    stated at --step when it was measured in steps of `measured_step`)."""
    steps, setup = run["steps"], run["setup"]
    ok = [s for s in steps if s["peak_rss"] <= budget]
    passed = len(ok) < len(steps) or run["end"]["end"] == "budget"
    row = {"system": system, "model": args.model, "budget_mib": round(budget / MIB, 1),
           "ended_by": "budget" if passed else run["end"]["end"],
           "curve": [(s["positions"], round(s["peak_rss"] / MIB, 1)) for s in steps], "steps": steps,
           **{k: v for k, v in setup.items() if k != "pid"}}
    if "error" in run:
        row["error"] = run["error"]
    if ok:
        last = ok[-1]
        row.update(positions=last["positions"], peak_mib=round(last["peak_rss"] / MIB, 1),
                   limited=not passed and run["end"]["end"] in ("time limit", "position limit"))
        if last.get("mlx_peak") is not None:
            row["mlx_peak_mib"] = round(last["mlx_peak"] / MIB, 1)
        for key in ("note", "kv_dtype", "kv_cache", "prefill_step", "weights_dtype", "kv_bits", "flash_attention",
                    "streamed_from_disk"):
            if key in last:
                row[key] = last[key]
        if last.get("kv_formats"):  # the share of each page format at the capacity step
            total = sum(last["kv_formats"].values())
            row["kv_formats"] = {k: round(v / total, 3) for k, v in sorted(last["kv_formats"].items())}
            row["kv_positions"] = dict(sorted(last["kv_formats"].items()))
    elif "error" not in row:
        row["error"] = f"no step completed within the budget ({row['ended_by']})"
    if run["end"]["end"] == "time limit" and "positions" in row and modelable(system, setup):
        model_row(row, run, budget, measured_step or args.step, args.step)
    return row


def modelable(system: str, setup: dict) -> bool:
    """Whether a run of `system` can be given a memory model: stock runs with their
    shape, single-process JustFit runs (a pipeline's peak is its largest rank's)."""
    return bool(setup.get("shape")) if not system.startswith("justfit") else "@" not in system

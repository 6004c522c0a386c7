"""Memory capacity: the most retained positions each system completes with the
whole process (model, weights and all) within a memory budget, over a sweep of budgets.

    python -m bench.capacity --model smollm2 --budgets preset    # 400,550,800,1100,1600MiB
    python -m bench.capacity --model smollm2 --budget 700MiB --llama-cpp ~/llama.cpp/build/bin
    python -m bench.capacity --quick          # minutes: small budget, short steps

Protocol (one growing run per system, each in its own process): a conversation that
grows by `--step` tokens of deterministic repetitive input, then `--out` generated
tokens (end-of-sequence never ends it), again and again; retained positions = input +
generated so far. The process's peak memory is sampled (RSS every 10 ms, and the
kernel's high-water mark); the first step whose peak passes the budget ends the run.
Capacity = positions after the last step that stayed within budget; after a budget
stop a second run repeats the steps that fitted and continues in steps of 1/8. At the
smallest budget each system runs `--repeats` times (min and max reported). JustFit also
stops when its planner refuses the next step. A run that hits `--max-positions` or
`--max-seconds` reports that it was limited; a stock float16 run so limited also gets
its fitted memory model's capacity, labelled `modeled` (bench/memmodel.py).

Stock systems run as their users do: float16 parameters, so float16 activations and
KV (bench/stock.py); they do not depend on the budget, so one run up to the largest
budget gives every budget's figure (each edge refined in its own run).

Systems: mlx-lm (defaults), mlx-lm-tuned (prefill_step_size 512, 8-bit KV in groups of
64 from the first token, mx.set_cache_limit(0); sliding-window layers float16, as mlx-lm
allows), mlx-lm-kv4 (tuned, 4-bit), llama.cpp (its defaults: float16 KV, flash attention
as it decides) / llama.cpp-q8_0 / llama.cpp-q4_0 (from `--llama-cpp DIR`, flash attention,
-ctk/-ctv, the same GGUF, whole-process peak RSS, n_ctx stepped), justfit-lossless (q8c pages, pressure ladder off), justfit-calibrated
(the CLI's default pages, calibrated per model, ladder off), justfit-default (the CLI's
defaults: calibrated pages stepping down the ladder as the budget tightens), justfit-disk (the
calibrated pages, ladder off, the pages the budget cannot hold on disk and read back just
in time: kvexec/disk_pages.py), justfit-compact (the
fewest bytes per position), justfit-retention (at most `--retain` positions kept); any
JustFit system with `+resident` keeps every weight in memory (EngineConfig.offload_weights
False: no layer streamed from disk at the budget's edge, as the others keep theirs).
JustFit rows carry `kv_formats`, `fidelity` (bench/fidelity.py) and
`past_trained_context`; headline ratios use only rows at top-1 >= 99%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.capacity_rows import MIB, row_at

SYSTEMS = ("mlx-lm", "mlx-lm-tuned", "mlx-lm-kv4", "llama.cpp", "llama.cpp-q8_0", "llama.cpp-q4_0", "justfit-lossless",
           "justfit-calibrated", "justfit-default", "justfit-disk", "justfit-compact", "justfit-retention")
QUICK = {"budget": "600MiB", "step": 256, "out": 16, "max_positions": 2048, "max_seconds": 120, "repeats": 1,
         "fidelity_tokens": 0}


def _grow(system: str, args, budget: int, fine_from: int = 0, fine_step: int = 0, step: int = 0,
          limit: int = 0) -> dict:
    """One growing run in a fresh process (steps of `step` tokens, else --step; at most
    `limit` positions, else --max-positions): {"setup", "steps", "end", "error"?}."""
    from bench.common import progress_bar

    cmd = [sys.executable, "-m", "bench.capacity", "--worker", system, "--model", args.model,
           "--budget", str(budget), "--step", str(step or args.step), "--out", str(args.out),
           "--max-positions", str(limit or args.max_positions), "--max-seconds", str(args.max_seconds),
           "--retain", str(args.retain), "--fine-from", str(fine_from), "--fine-step", str(fine_step),
           "--start-at", str(args.start_at)]
    ranks = int(system.partition("@")[2] or 1)
    if ranks > 1:  # a layer pipeline: every rank a worker, each held to the budget
        from justfit.pipeline.launch import launched

        cmd = launched(ranks, cmd)
    run = {"setup": {}, "steps": [], "end": {"end": "crashed"}}
    others = 0  # the largest peak any other rank reported
    bar = progress_bar(args.max_positions, f"{system} @ {budget / MIB:.0f} MiB" + (" (finer)" if fine_step else ""),
                       "pos")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "rank" in item:
            others = max(others, item["peak_rss"])
        elif "setup" in item:
            run["setup"] = item["setup"]
        elif "end" in item:
            run["end"] = item
        else:
            if ranks > 1:
                item.update(rank0_peak_rss=item["peak_rss"], peak_rss=max(item["peak_rss"], others))
            run["steps"].append(item)
            bar.update(item["positions"] - bar.n)
            if bar.disable and not args.json:  # no terminal: a line per step for the log
                print(f"  {system}: {item['positions']:,} positions, peak {item['peak_rss'] / MIB:.0f} MiB "
                      f"({item['step_s']} s)", file=sys.stderr, flush=True)
    bar.close()
    err = proc.stderr.read()
    proc.wait()
    if run["end"]["end"] == "crashed":
        run["error"] = f"exit {proc.returncode}: {(err.strip().splitlines() or ['no output'])[-1]}"
    return run


def _refined(system: str, args, budget: int, row: dict) -> dict:
    """After a budget stop, a second run repeating the steps that fitted, then 1/8 steps."""
    if not args.refine or row.get("ended_by") != "budget" or "positions" not in row:
        return row
    fine = row_at(system, args, budget, _grow(system, args, budget, row["positions"], max(32, args.step // 8)))
    if fine.get("positions", 0) >= row["positions"]:
        return {**fine, "coarse_positions": row["positions"]}
    return row


def _repeat(system: str, args, budget: int, row: dict) -> dict:
    """Run again at `budget` (args.repeats in all): the row gains min and max."""
    got = [row.get("positions")]
    for _ in range(args.repeats - 1):
        again = _refined(system, args, budget, row_at(system, args, budget, _grow(system, args, budget)))
        got.append(again.get("positions"))
    if args.repeats > 1:
        ok = [g for g in got if g is not None]
        row = {**row, "repeat_positions": got, **({"min_positions": min(ok), "max_positions": max(ok)} if ok else {})}
    return row


def _stock_rows(system: str, args, budgets: list[int]) -> list[dict]:
    """A stock system's rows: one run to the largest budget, in steps of --stock-step
    where given (float16 mlx-lm needs minutes per hundred tokens here). mlx-lm-fp32,
    fast enough for both, also runs at --step and gains `model_check`: the short
    run's memory model against what the full steps measured."""
    measured = getattr(args, "stock_step", 0) or args.step
    checking = system == "mlx-lm-fp32" and measured != args.step
    # the check fits its model to as few short steps as a float16 run completes here (two)
    run = _grow(system, args, max(budgets), step=measured, limit=2 * (measured + args.out) if checking else 0)
    if checking:
        from bench.capacity_model import check

        full = _grow(system, args, max(budgets))
        checked = check(system, run, full, measured, args.step, budgets)
        return [{**_refined(system, args, b, row_at(system, args, b, full)), "model_check": checked} for b in budgets]
    rows = [_refined(system, args, b, row_at(system, args, b, run, measured)) for b in budgets]
    return [{**r, "measured_step_tokens": measured} for r in rows]


def sweep(system: str, args, budgets: list[int]) -> list[dict]:
    """Every budget's row for one system (ascending budgets)."""
    if system.startswith("llama.cpp"):
        from bench.capacity_llama import llama_rows

        return llama_rows(system, args, budgets)
    if system.startswith("justfit"):
        rows = [_refined(system, args, b, row_at(system, args, b, _grow(system, args, b))) for b in budgets]
    else:  # stock: independent of the budget, one run to the largest
        rows = _stock_rows(system, args, budgets)
    if "measured_step_tokens" not in rows[0] or rows[0]["measured_step_tokens"] == args.step:
        rows[0] = _repeat(system, args, budgets[0], rows[0])  # (a short-step stock run is modeled: no repeats)
    for r in rows:
        r["step_tokens"] = args.step
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budget", default="900MiB", help="whole-process memory budget (one)")
    ap.add_argument("--budgets", default=None, help="a sweep, e.g. 400,550,800,1100,1600MiB, or 'preset' "
                                                    "(the model's: bench/sweep.py)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--step", type=int, default=2048,
                    help="input tokens per step (2048: mlx-lm's prefill chunk, so each step's transient "
                         "is that of a fresh run's last chunk)")
    ap.add_argument("--out", type=int, default=256, help="generated tokens per step")
    ap.add_argument("--stock-step", type=int, default=0,
                    help="input tokens per step for the stock mlx-lm systems (0: --step); a run "
                         "stopped by its clock is modeled at --step (bench/capacity_model.py)")
    ap.add_argument("--max-positions", type=int, default=65536)
    ap.add_argument("--max-seconds", type=float, default=3600, help="per run")
    ap.add_argument("--retain", type=int, default=4096, help="positions justfit-retention keeps")
    ap.add_argument("--repeats", type=int, default=3, help="runs at the smallest budget (min and max reported)")
    ap.add_argument("--fidelity-tokens", type=int, default=8192,
                    help="teacher-forced tokens for each JustFit row's format mix (0: not measured)")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR", help="folder with llama.cpp's llama-bench")
    ap.add_argument("--llama-validate", default="", metavar="N,N",
                    help="contexts at which llama.cpp rows also run a full pass (llama-bench) to check the "
                         "reserved-memory edge")
    ap.add_argument("--no-refine", dest="refine", action="store_false",
                    help="skip the second, finer run after a budget stop")
    ap.add_argument("--start-at", type=int, default=0, metavar="N",
                    help="JustFit systems: begin with N positions of random keys and values written straight into "
                         "pages (no prefill), then grow as usual: the memory of a long context without its prefill "
                         "(rows say synthetic_start)")
    ap.add_argument("--fine-from", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fine-step", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from bench.common import apply_quick

    apply_quick(args, QUICK, argv)
    if args.worker:
        if args.worker.startswith("justfit"):
            from justfit import runtime

            runtime.setup()  # OpenBLAS before anything loads mlx.core
        else:
            import mlx.core  # noqa: F401  (before justfit: stock runs the wheel's own BLAS, as its users do)
        from bench.capacity_worker import run_worker
        from justfit.memory import parse_size

        run_worker(args.worker, args.model, parse_size(args.budget), args.step, args.out, args.max_positions,
                   args.max_seconds, args.retain, args.fine_from, args.fine_step, args.start_at)
        return {}
    from bench import fidelity
    from bench.common import machine_info
    from bench.report import publish
    from bench.sweep import headline, parse_budgets
    from justfit.memory import parse_size

    names = parse_budgets(args.budgets, args.model) if args.budgets else [args.budget]
    budgets = sorted(parse_size(b) for b in names)
    rows = []
    for system in args.systems.split(","):
        rows += sweep(system, args, budgets)
        if not args.json:
            for r in rows[-len(budgets):]:
                print(json.dumps({k: v for k, v in r.items() if k not in ("curve", "steps")}), file=sys.stderr,
                      flush=True)
    fidelity.attach(rows, args.model, args.fidelity_tokens)
    for r in rows:
        fidelity.mark(r)
    settings = {k: getattr(args, k) for k in ("model", "budget", "step", "stock_step", "out", "max_positions",
                                              "max_seconds", "start_at",
                                              "retain", "refine", "repeats", "fidelity_tokens")}
    settings.update(budget=names[0] if len(names) == 1 else ",".join(names), budgets=names)
    result = {"machine": machine_info(), "settings": settings, "systems": rows, "headline": headline(rows)}
    publish("capacity", result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

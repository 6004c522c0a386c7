"""Memory capacity: the most retained positions each system completes with the
whole process (model, weights and all) within a memory budget.

    python -m bench.capacity --model smollm2 --budget 700MiB
    python -m bench.capacity --quick          # minutes: small budget, short steps

Protocol (one growing run per system, each in its own process): a conversation that
grows by `--step` tokens of deterministic repetitive input, then `--out` generated
tokens (end-of-sequence never ends it), again and again; retained positions = input +
generated so far. The process's peak memory is sampled (RSS every 10 ms, and the
kernel's high-water mark); the first step whose peak passes the budget ends the run,
and the process is stopped as soon as RSS crosses it. Capacity = positions after the
last step that stayed within budget; after a budget stop a second run repeats the steps
that fitted and continues in steps of 1/8 (a finer last step is kinder to the system
measured, the same for all). JustFit also stops when its planner refuses the
next step (it would not fit). A run that hits `--max-positions` or `--max-seconds`
reports that it was limited, not the capacity. Every system gets the same input
tokens and the same output length per step.

Systems: mlx-lm (stock `generate_step`, default KV), mlx-lm-kv4 (`kv_bits=4`,
`quantized_kv_start=0`; on sliding-window models, the caches mlx-lm can quantize),
justfit-default (q8c pages, stepping down KVExec's pressure ladder as the budget
tightens; the row's `kv_formats` says how far), justfit-compact (the format with the
fewest bytes per position), justfit-retention (default pages, at most `--retain`
positions kept: sinks, recent window and the most attended pages).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

SYSTEMS = ("mlx-lm", "mlx-lm-kv4", "justfit-default", "justfit-compact", "justfit-retention")
QUICK = {"budget": "600MiB", "step": 256, "out": 16, "max_positions": 2048, "max_seconds": 120}


class _Peak(threading.Thread):
    """Samples this process's RSS; exits the process (status 3) past the budget."""

    def __init__(self, budget: int):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.budget, self.peak = psutil.Process(), budget, 0

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            if self.peak > self.budget:
                print(json.dumps({"end": "budget", "peak_rss": self.peak}), flush=True)
                os._exit(3)
            time.sleep(0.01)


def _stock(model: str, kv_bits: int | None):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from justfit.models import load

    loaded = load(model)
    cache = make_prompt_cache(loaded.model)
    eos = list(loaded.tokenizer.eos_token_ids)
    note = _quantize_what_mlx_lm_can(cache) if kv_bits else ""

    def no_eos(tokens, logits):  # end-of-sequence suppressed
        return logits.at[..., eos].add(-1e9) if eos else logits

    def step(tokens: list[int], out: int) -> list[int]:
        kw = {"kv_bits": kv_bits, "quantized_kv_start": 0} if kv_bits else {}
        gen = generate_step(mx.array(tokens), loaded.model, prompt_cache=cache, max_tokens=out,
                            sampler=make_sampler(0.0), logits_processors=[no_eos], **kw)
        return [int(t) for t, _ in gen]

    return loaded.tokenizer, step, (lambda: {"note": note} if note else {})


def _quantize_what_mlx_lm_can(cache: list) -> str:
    """mlx-lm raises on `kv_bits` for sliding-window caches (RotatingKVCache:
    "Quantization NYI"), so on models that have them (Gemma 3) the kv4 system quantizes
    every other cache, as mlx-lm's own `maybe_quantize_kv_cache` does, and leaves those
    in fp16 (they hold one window each). Returns a note saying so, or ""."""
    import importlib

    from mlx_lm.models.cache import RotatingKVCache

    generate = importlib.import_module("mlx_lm.generate")  # the package's `generate` is the function

    rotating = sum(isinstance(c, RotatingKVCache) for c in cache)
    if not rotating:
        return ""
    quantize = generate.maybe_quantize_kv_cache

    def skipping_rotating(prompt_cache, *args, **kwargs):
        keep = [i for i, c in enumerate(prompt_cache) if not isinstance(c, RotatingKVCache)]
        part = [prompt_cache[i] for i in keep]
        quantize(part, *args, **kwargs)
        for i, c in zip(keep, part):
            prompt_cache[i] = c

    generate.maybe_quantize_kv_cache = skipping_rotating  # read when generate_step starts
    return f"kv4 on {len(cache) - rotating} of {len(cache)} layers; sliding-window layers fp16 (mlx-lm: NYI)"


def _justfit(model: str, system: str, budget: int, retain: int, limit: int):
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig
    from kvexec import FORMATS, KVConfig, get_format

    # The budget is the whole process's: the engine takes off what the interpreter,
    # libraries and tokenizer hold beside it, measured at load.
    config = EngineConfig(context_limit=limit, budget_bytes=budget, budget_covers_process=True)
    if system == "justfit-retention":
        config.kv = KVConfig(max_positions=retain, pin_prompt=False)
    engine = Engine(model, config=config)
    if system == "justfit-compact":  # chosen for this model's head_dim, before any request
        head_dim = engine.kv_shape[2]
        usable = [f for f in FORMATS if get_format(f).supports_head_dim(head_dim)]
        # fewest bytes per position; of equals, per-channel keys (the better fidelity)
        engine.config.kv = KVConfig(format=min(usable, key=lambda f: (get_format(f).bytes_per_token(1, head_dim),
                                                                    not f.endswith("c"))))
    history: list[int] = []

    def step(tokens: list[int], out: int) -> list[int]:
        nonlocal history
        sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        got = [c.token for c in engine.generate(history + tokens, sp) if c.token is not None]
        history = history + tokens + got
        return got

    def details() -> dict:
        """How the last step ran: prefill chunk, and paged positions per KV format
        (over all layers; several once pages stepped down under the budget)."""
        stats = engine.last_stats
        if stats is None:
            return {}
        return {"prefill_chunk": stats.prefill_chunk, "kv_formats": stats.kv_formats,
                "planned": stats.planned_bytes, "engine_budget": engine.config.budget_bytes,
                "mlx_phase_peaks": [p.peak_bytes for p in stats.phases]}

    return engine.tokenizer, step, details


def _worker(system: str, model: str, budget: int, step_tokens: int, out: int, max_positions: int,
            max_seconds: float, retain: int, fine_from: int = 0, fine_step: int = 0) -> None:
    """Prints one JSON line per completed step, then {"end": reason}."""
    if system.startswith("justfit"):
        import justfit  # noqa: F401  (OpenBLAS before mlx.core)
    import mlx.core as mx

    from bench.common import prompt_tokens
    from justfit.errors import JustFitError
    from justfit.memory import peak_rss_bytes

    sampler = _Peak(budget)
    sampler.start()
    if system.startswith("justfit"):
        tokenizer, step, details = _justfit(model, system, budget, retain, max_positions + out + 1)
    else:
        tokenizer, step, details = _stock(model, 4 if system == "mlx-lm-kv4" else None)
    text = prompt_tokens(tokenizer, max_positions)
    fed = generated = 0
    pending: list[int] = []  # the last generated token: fed with the next step
    start = time.perf_counter()
    while True:
        size = fine_step if fine_from and fed + generated >= fine_from else step_tokens
        if fed + generated + size + out > max_positions:
            break
        if time.perf_counter() - start > max_seconds:
            print(json.dumps({"end": "time limit"}), flush=True)
            return
        t0 = time.perf_counter()
        try:
            got = step(pending + text[fed:fed + size], out)
        except JustFitError as e:
            print(json.dumps({"end": "planner refused", "reason": str(e)}), flush=True)
            return
        fed, generated = fed + size, generated + len(got)
        pending = got[-1:]
        peak = max(sampler.peak, peak_rss_bytes())
        print(json.dumps({"positions": fed + generated, "input": fed, "generated": generated,
                          "peak_rss": peak, "mlx_peak": mx.get_peak_memory(),
                          "step_s": round(time.perf_counter() - t0, 2), **details()}), flush=True)
        if peak > budget:
            print(json.dumps({"end": "budget", "peak_rss": peak}), flush=True)
            return
    print(json.dumps({"end": "position limit"}), flush=True)


def run_system(system: str, args, budget: int) -> dict:
    """One system's capacity row: a growing run in a fresh process; when it ended on the
    budget, a second run repeats the steps that fitted and goes on in steps of 1/8."""
    row = _grow(system, args, budget)
    if args.refine and row.get("ended_by") == "budget" and "positions" in row:
        fine = _grow(system, args, budget, row["positions"], max(32, args.step // 8))
        if fine.get("positions", 0) >= row["positions"]:
            fine["coarse_positions"] = row["positions"]
            return fine
    return row


def _grow(system: str, args, budget: int, fine_from: int = 0, fine_step: int = 0) -> dict:
    cmd = [sys.executable, "-m", "bench.capacity", "--worker", system, "--model", args.model,
           "--budget", str(budget), "--step", str(args.step), "--out", str(args.out),
           "--max-positions", str(args.max_positions), "--max-seconds", str(args.max_seconds),
           "--retain", str(args.retain), "--fine-from", str(fine_from), "--fine-step", str(fine_step)]
    from bench.common import progress_bar

    steps, end = [], {"end": "crashed"}
    bar = progress_bar(args.max_positions, system + (" (finer steps)" if fine_step else ""), "pos")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "end" in item:
            end = item
        else:
            steps.append(item)
            bar.update(item["positions"] - bar.n)
            bar.set_postfix_str(f"peak {item['peak_rss'] / 2**20:.0f} MiB, step {item['step_s']} s")
            if bar.disable and not args.json:  # no terminal: a line per step for the log
                plan = f", planned {item['planned'] / 2**20:.0f} of {item['engine_budget'] / 2**20:.0f} MiB, " \
                    f"chunk {item['prefill_chunk']}, pages {item['kv_formats']}" if "planned" in item else ""
                print(f"  {system}: {item['positions']:,} positions, peak {item['peak_rss'] / 2**20:.0f} MiB "
                      f"({item['step_s']} s{plan})", file=sys.stderr, flush=True)
    bar.close()
    err = proc.stderr.read()
    proc.wait()
    ok = [s for s in steps if s["peak_rss"] <= budget]
    row = {"system": system, "model": args.model, "budget_mib": round(budget / 2**20, 1),
           "ended_by": end["end"], "curve": [(s["positions"], round(s["peak_rss"] / 2**20, 1)) for s in steps],
           "steps": steps}
    if end["end"] == "crashed":
        row["error"] = f"exit {proc.returncode}: {(err.strip().splitlines() or ['no output'])[-1]}"
    if ok:
        row.update(positions=ok[-1]["positions"], peak_mib=round(ok[-1]["peak_rss"] / 2**20, 1),
                   mlx_peak_mib=round(ok[-1]["mlx_peak"] / 2**20, 1),
                   limited=end["end"] in ("time limit", "position limit"))
        if ok[-1].get("note"):
            row["note"] = ok[-1]["note"]
        if ok[-1].get("kv_formats"):  # the share of each page format at the capacity step
            total = sum(ok[-1]["kv_formats"].values())
            row["kv_formats"] = {k: round(v / total, 3) for k, v in sorted(ok[-1]["kv_formats"].items())}
    elif "error" not in row:
        row["error"] = f"no step completed within the budget ({end['end']})"
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budget", default="900MiB", help="whole-process memory budget")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--step", type=int, default=2048,
                    help="input tokens per step (2048: mlx-lm's prefill chunk, so each step's transient "
                         "is that of a fresh run's last chunk)")
    ap.add_argument("--out", type=int, default=256, help="generated tokens per step")
    ap.add_argument("--max-positions", type=int, default=65536)
    ap.add_argument("--max-seconds", type=float, default=3600, help="per system")
    ap.add_argument("--retain", type=int, default=4096, help="positions justfit-retention keeps")
    ap.add_argument("--no-refine", dest="refine", action="store_false",
                    help="skip the second, finer run after a budget stop")
    ap.add_argument("--fine-from", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fine-step", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from bench.common import apply_quick
    from justfit.memory import parse_size

    apply_quick(args, QUICK, argv)

    budget = parse_size(args.budget)
    if args.worker:
        _worker(args.worker, args.model, budget, args.step, args.out, args.max_positions, args.max_seconds,
                args.retain, args.fine_from, args.fine_step)
        return {}
    from bench.common import machine_info, publish

    rows = []
    for system in args.systems.split(","):
        rows.append(run_system(system, args, budget))
        if not args.json:
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("curve", "steps")}), file=sys.stderr,
                  flush=True)
    settings = {k: getattr(args, k) for k in ("model", "budget", "step", "out", "max_positions", "max_seconds",
                                              "retain", "refine")}
    result = {"machine": machine_info(), "settings": settings, "systems": rows}
    publish("capacity", result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

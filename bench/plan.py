"""The planner against measurement: predicted peak memory vs the MLX peak measured while
a real request runs, per KV format and length; and a generation under a budget below
the weights, which must stream layers and still match the resident run token for token;
and the whole-process breakdown (justfit.planning.breakdown) at load and after a request,
its measured parts (all but `unaccounted`) checked against RSS within 5%.

    python -m bench.plan peaks --model smollm2 --formats q8c,q4c,fp16 --contexts 1024,2048,4096
    python -m bench.plan stream --model smollm2 --budget 150MiB --context 1024
    python -m bench.plan breakdown --model smollm2 --context 4096

Each measurement runs in its own process so peaks do not mix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DECODE = 8
# The measured parts of the breakdown, `unaccounted` left out, account for RSS within this share.
BREAKDOWN_TOLERANCE = 0.05


def _engine(model: str, fmt: str, budget: str | None = None):
    from justfit import Engine
    from justfit.config import EngineConfig
    from kvexec import KVConfig

    kv = None if fmt == "mlx-lm" else KVConfig(format=fmt)
    return Engine(model, budget=budget, config=EngineConfig(kv=kv))


def _generate(engine, context: int) -> tuple[list[int], object]:
    from bench.common import prompt_tokens
    from justfit import SamplingParams

    tokens = prompt_tokens(engine.tokenizer, context - DECODE)
    sp = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True)
    reply = engine.reply(tokens, sp)
    return reply.tokens, reply.stats


def peak_worker(model: str, fmt: str, context: int) -> dict:
    from justfit import runtime

    runtime.setup()  # OpenBLAS must load before mlx.core
    import mlx.core as mx

    engine = _engine(model, fmt)
    predicted = engine.planner.footprint(context)
    _, stats = _generate(engine, context)
    measured = max(mx.get_peak_memory(), stats.memory.mlx_peak)
    return {"model": model, "format": fmt, "context": context, "predicted": predicted.total,
            "predicted_terms": predicted.as_dict(), "measured_mlx_peak": measured,
            "error": (predicted.total - measured) / measured,
            "phases": [p.as_dict() for p in stats.phases]}


def stream_worker(model: str, budget: str, context: int) -> dict:
    from justfit import runtime

    runtime.setup()  # OpenBLAS must load before mlx.core
    import mlx.core as mx

    from justfit.memory import parse_size

    free = _engine(model, "q8c")
    expected, free_stats = _generate(free, context)
    weights = free.swap.registry.total_bytes()
    del free
    mx.clear_cache()
    tight = _engine(model, "q8c", budget)
    offloaded, predicted = tight.planner.plan(context)
    got, stats = _generate(tight, context)
    prefill, decode = stats.phases
    return {"model": model, "budget": parse_size(budget), "weights": weights, "context": context,
            "offloaded": list(offloaded), "predicted": predicted.total,
            "measured_mlx_peak": stats.memory.mlx_peak, "token_identical": got == expected,
            "resident_prefill_tps": free_stats.prefill_tps, "resident_decode_tps": free_stats.decode_tps,
            "streamed_prefill_tps": stats.prefill_tps, "streamed_decode_tps": stats.decode_tps,
            "disk_read_bytes": prefill.disk_read_bytes + decode.disk_read_bytes,
            "phases": [p.as_dict() for p in stats.phases]}


def check_breakdown(b: dict, tolerance: float = BREAKDOWN_TOLERANCE) -> dict:
    """A breakdown (justfit.planning.breakdown.process_breakdown) against RSS: its parts,
    the sum of the measured ones (every part but `unaccounted`), the RSS, the share of
    it the measured parts leave out (|RSS - sum| / RSS) and whether that is within
    `tolerance`."""
    parts = b["parts"]
    measured = sum(v for k, v in parts.items() if k != "unaccounted")
    rss = b["rss"]
    gap = abs(rss - measured) / rss if rss else 1.0
    return {"parts": dict(parts), "measured_sum": measured, "rss": rss, "gap": gap,
            "within": gap <= tolerance, "tolerance": tolerance, "outside_mlx": b["outside_mlx"],
            "peaks": b["peaks"]}


def breakdown_worker(model: str, tokens: str | int, context: int) -> dict:
    """Load `model`, break the process down, run one greedy request of `context`
    positions (`tokens` of them generated), break it down again: each checked against RSS."""
    from justfit import runtime

    runtime.setup()  # OpenBLAS must load before mlx.core
    from bench.common import prompt_tokens
    from justfit import Engine, SamplingParams
    from justfit.planning.breakdown import process_breakdown
    from justfit.planning.fit import kv_label

    engine = Engine(model)
    loaded = check_breakdown(process_breakdown(engine))
    tokens = int(tokens)
    prompt = prompt_tokens(engine.tokenizer, context - tokens)
    reply = engine.reply(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    after = check_breakdown(process_breakdown(engine, last=reply.stats))
    kv = engine.config.kv
    return {"model": model, "context": context, "tokens": tokens, "kv": kv_label(kv) if kv else "mlx-lm's cache",
            "load": loaded, "after_request": after, "within": loaded["within"] and after["within"]}


def breakdown_table(row: dict) -> list[str]:
    """A row's breakdowns as a text table: a line per part (MiB at load, after the request),
    then the measured sum, the RSS and the check."""
    if "error" in row:
        return [f"error: {row['error']}"]
    load, after = row["load"], row["after_request"]
    mib = 2**20
    lines = [f"{row['model']}, {row['context']:,} positions ({row['tokens']} generated)",
             f"  {'part':<13} {'at load':>10} {'after':>10}   (MiB)"]
    for name in load["parts"]:
        lines.append(f"  {name.replace('_', ' '):<13} {load['parts'][name] / mib:>10.1f} "
                     f"{after['parts'][name] / mib:>10.1f}")
    lines += [f"  {'measured sum':<13} {load['measured_sum'] / mib:>10.1f} {after['measured_sum'] / mib:>10.1f}",
              f"  {'RSS':<13} {load['rss'] / mib:>10.1f} {after['rss'] / mib:>10.1f}",
              f"  {'gap':<13} {100 * load['gap']:>9.1f}% {100 * after['gap']:>9.1f}%",
              f"  within {100 * load['tolerance']:g}% of RSS: at load {'yes' if load['within'] else 'NO'}, "
              f"after the request {'yes' if after['within'] else 'NO'}"]
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        kind, model, arg, context = argv[1:]
        fn = {"peaks": peak_worker, "stream": stream_worker, "breakdown": breakdown_worker}[kind]
        print(json.dumps(fn(model, arg, int(context))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("peaks")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--formats", default="q8c,q4c,fp16")
    p.add_argument("--contexts", default="1024,2048,4096")
    s = sub.add_parser("stream")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--budget", default="150MiB")
    s.add_argument("--context", type=int, default=1024)
    b = sub.add_parser("breakdown", help="the whole-process breakdown at load and after a request, against RSS")
    b.add_argument("--model", default="smollm2")
    b.add_argument("--context", type=int, default=4096)
    b.add_argument("--tokens", type=int, default=DECODE, help="tokens generated (greedy) of the context")
    args = ap.parse_args(argv)

    from bench.common import machine_info, run_worker, save

    rows = []
    if args.what == "peaks":
        for fmt in args.formats.split(","):
            for context in [int(c) for c in args.contexts.split(",")]:
                rows.append(run_worker("bench.plan", ["peaks", args.model, fmt, str(context)], 3600))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "phases"}), file=sys.stderr, flush=True)
    elif args.what == "stream":
        rows.append(run_worker("bench.plan", ["stream", args.model, args.budget, str(args.context)], 3600))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    else:
        rows.append(run_worker("bench.plan", ["breakdown", args.model, str(args.tokens), str(args.context)], 3600))
        print("\n".join(breakdown_table(rows[-1])), file=sys.stderr, flush=True)
    path = save(f"plan-{args.what}", {"machine": machine_info(), "rows": rows})
    print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

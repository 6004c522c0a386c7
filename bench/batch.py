"""Batching (justfit.engine.batch), side by side with batching off in one run.

    python -m bench.batch decode --streams 1,2,4,8 --context 1024 --tokens 32 --repeats 3
    python -m bench.batch ttft --context 8000 --short 64
    python -m bench.batch preempt --context 2048 --tokens 64 --sequences 4

decode: in one process, N sequences each prefilled to `--context` positions, then
`--tokens` greedy tokens each: one at a time (each sequence's steps alone, as the
server without --max-batch runs them) vs batched (one step for all N). Reports
aggregate tok/s of both, their ratio, and whether every sequence's greedy tokens are
the same both ways.
ttft: a `justfit serve` subprocess with --max-batch 1 and then 2; a `--context`-token
request starts, and once its prefill is under way a `--short`-token one arrives: its
time to first token, and the long request's total time.
preempt: four long sequences under a budget for two (bench.batch_preempt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def _decode_rows(args) -> list[dict]:
    from bench.common import prompt_tokens
    from justfit import Engine
    from justfit.engine.batch import decode_step
    from justfit.config import EngineConfig
    from justfit.engine.generate import prefill

    engine = Engine(args.model, config=EngineConfig(policy=args.policy))
    most = max(int(n) for n in args.streams.split(","))
    text = prompt_tokens(engine.tokenizer, args.context + 64 * most)
    rows = []
    for n in (int(x) for x in args.streams.split(",")):
        times = {"alone": [], "batched": []}
        differ = 0  # repeats whose greedy tokens differ between the two ways
        for repeat in range(-1, args.repeats):  # repeat -1 warms up and is not kept
            out = {}
            for mode in ("alone", "batched"):
                caches, first = [], []
                with engine.swap.phase("prefill"):
                    for i in range(n):  # distinct prompts: each starts 64 tokens further in
                        cache = engine.new_cache()
                        logits = prefill(engine.model, text[64 * i:64 * i + args.context], cache, 512)
                        caches.append(cache)
                        first.append(int(logits.argmax().item()))
                tokens, seqs = list(first), [[t] for t in first]
                start = time.perf_counter()
                if mode == "batched":  # one step for all, as the scheduler's step runs it (justfit.engine.batch.forward)
                    steps = (lambda toks: decode_step(engine.model, toks, caches) for _ in range(args.tokens - 1))
                    phase = engine.swap.phase("decode")
                else:  # each sequence's steps alone, in one decode phase
                    steps = (lambda toks: [decode_step(engine.model, [t], [c])[0] for t, c in zip(toks, caches)]
                             for _ in range(args.tokens - 1))
                    phase = engine.swap.phase("decode")
                with phase:
                    for step in steps:
                        tokens = [int(row.argmax().item()) for row in step(tokens)]
                        for s, t in zip(seqs, tokens):
                            s.append(t)
                if repeat >= 0:
                    times[mode].append(n * (args.tokens - 1) / (time.perf_counter() - start))
                out[mode] = seqs
            differ += repeat >= 0 and out["alone"] != out["batched"]
        rows.append({"streams": n, "context": args.context, "tokens": args.tokens, "policy": engine.policy.name,
                     "alone_tps": [round(t, 2) for t in times["alone"]],
                     "batched_tps": [round(t, 2) for t in times["batched"]],
                     "ratio_median": round(statistics.median(times["batched"]) / statistics.median(times["alone"]), 2),
                     "greedy_identical": differ == 0, "repeats_differing": differ})
        print(json.dumps(rows[-1]), flush=True)
    return rows


async def _ttft(args, max_batch: int) -> dict:
    import aiohttp

    from bench.serve import long_message
    from bench.server_process import served

    long_text, short_text = long_message(args.model, args.context), long_message(args.model, args.short)
    async with served(args.model, "--max-batch", str(max_batch)) as srv:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            async def stream(text: str, n: int) -> tuple[float, float]:
                body = {"prompt": text, "max_tokens": n, "temperature": 0, "stream": True}
                start, first = time.monotonic(), None
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.monotonic() - start
                return first, time.monotonic() - start

            long = asyncio.ensure_future(stream(long_text, 4))
            await asyncio.sleep(args.delay)  # the long prefill is under way
            short_first, short_total = await stream(short_text, 8)
            long_first, long_total = await long
    return {"max_batch": max_batch, "context": args.context, "short": args.short,
            "short_ttft_s": round(short_first, 2), "short_total_s": round(short_total, 2),
            "long_ttft_s": round(long_first, 2), "long_total_s": round(long_total, 2)}


def main(argv: list[str] | None = None) -> dict:
    """Run the chosen mode; save bench/results/batch-TIME.json."""
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core
    from bench.common import machine_info
    from bench.report import publish

    ap = argparse.ArgumentParser(prog="bench.batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["decode", "ttft", "preempt"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policy", default="auto", help="decode: the residency policy")
    ap.add_argument("--streams", default="1,2,4,8", help="decode: sequences at once")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32, help="decode: tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="kept repeats (after one warm-up)")
    ap.add_argument("--sequences", type=int, default=4, help="preempt: long sequences")
    ap.add_argument("--short", type=int, default=64, help="ttft: tokens in the short request")
    ap.add_argument("--delay", type=float, default=3.0, help="ttft: seconds between the two requests")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.which == "decode":
        rows = _decode_rows(args)
    elif args.which == "preempt":
        from bench.batch_preempt import preempt_rows

        rows = preempt_rows(args)
    else:
        rows = [asyncio.run(_ttft(args, 1)), asyncio.run(_ttft(args, 2))]
    result = {"machine": machine_info(), "settings": vars(args), "systems": rows}
    publish("batch", result, args.json)
    return result


if __name__ == "__main__":
    main()

"""StateTrans: time to first token continuing a long conversation from a snapshot vs
cold prefill (and from the engine's own disk and memory tiers), snapshot size vs the
in-memory state, save/restore throughput.

    python -m bench.state --model smollm2 --context 8192
    python -m bench.state --restart --model smollm2 --context 8192   (bench/state_restart.py)

The conversation is `context` tokens of text; the follow-up is one more user turn.
Cold: a fresh engine prefills conversation + follow-up. Warm: the conversation's state
was saved to disk; a fresh engine loads it and prefills only the follow-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def run(model: str, context: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="justfit-state-bench-") as scratch:
        return _run(model, context, scratch)


def _run(model: str, context: int, scratch: str) -> dict:
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core
    from bench.common import prompt_tokens
    from justfit import Engine, SamplingParams
    from justfit.engine.stats import collect

    # Stored states go to a fresh folder: nothing from earlier runs may warm the cold run.
    os.environ["JUSTFIT_STATE_DIR"] = os.path.join(scratch, "state")
    one = SamplingParams(temperature=0, max_tokens=1)
    engine = Engine(model)
    history = prompt_tokens(engine.tokenizer, context)
    follow = list(engine.tokenizer.encode(" Now summarize the above in one sentence."))
    start = time.perf_counter()
    next(iter(engine.generate(history + follow, one)))
    cold = time.perf_counter() - start

    engine.reset()
    list(engine.generate(history, one))  # the conversation so far, computed
    path = os.path.join(scratch, "conversation")
    saved = engine.save_state(path)
    # The same continuation from the engine's own tiers: spilled to disk, then in memory.
    engine.states.spill(engine.states.last)
    start = time.perf_counter()
    gen = engine.generate(history + follow, one)
    first = next(gen)
    disk_tier = time.perf_counter() - start
    source = (collect(gen).stats or first.stats).restored_from  # the rest read after the clock stops
    start = time.perf_counter()
    next(iter(engine.generate(engine.cached_tokens + follow, one)))
    memory_tier = time.perf_counter() - start

    warm_engine = Engine(model)
    start = time.perf_counter()
    loaded = warm_engine.load_state(path)
    gen = warm_engine.generate(history + follow, one)
    first = next(gen)
    warm = time.perf_counter() - start
    warm_stats = collect(gen).stats or first.stats
    return {"model": model, "context": context, "follow_up_tokens": len(follow),
            "ttft_cold_s": cold, "ttft_from_snapshot_s": warm, "speedup": cold / warm,
            "ttft_disk_tier_s": disk_tier, "disk_tier_source": source, "ttft_memory_tier_s": memory_tier,
            "restore_s": loaded.seconds, "state_bytes": saved.state_bytes, "snapshot_bytes": saved.file_bytes,
            "snapshot_over_state": saved.file_bytes / saved.state_bytes - 1,
            "save_mb_s": saved.mb_per_s, "restore_mb_s": loaded.mb_per_s,
            "cached_tokens": warm_stats.cached_tokens}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192 - 64)
    ap.add_argument("--restart", action="store_true", help="a named session across an engine restart, and "
                    "the cost of writing it through (bench/state_restart.py)")
    args = ap.parse_args(argv)
    from bench.common import machine_info, save

    if args.restart:
        from bench import state_restart

        with tempfile.TemporaryDirectory(prefix="justfit-state-bench-") as scratch:
            row = state_restart.run(args.model, args.context, scratch)
        print(json.dumps(row), file=sys.stderr)
        print(f"saved {save('state-restart', {'machine': machine_info(), 'rows': [row]})}", file=sys.stderr)
        return
    row = run(args.model, args.context)
    print(json.dumps(row), file=sys.stderr)
    print(f"saved {save('state', {'machine': machine_info(), 'rows': [row]})}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

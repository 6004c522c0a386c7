"""Preemption under a budget that holds two long sequences (bench.batch preempt).

Four `--context`-token sequences each generate `--tokens` greedy tokens under a budget
of weights + the largest transient + two sequences' KV at full length: each alone
first (the reference tokens), then batched with preemption (more admitted, the newest
parked on disk through StateTrans when the batch would outgrow the budget, resumed
later), then batched without it (each counted at its full length, so two run at once).
Reports wall time, whether every sequence's tokens equal its alone run, preemptions,
swap seconds and each sequence's time set aside.
"""

from __future__ import annotations

import json
import time

from bench.common import prompt_tokens


def _engine(args):
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig

    # A loose budget first, so the policy is the one a budget picks; then the budget for two.
    engine = Engine(args.model, config=EngineConfig(policy=args.policy, budget_bytes=8 << 30))
    # One request first: the planner's reserve measured, as the batches' requests plan with it.
    engine.reply(prompt_tokens(engine.tokenizer, args.context), SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                              ignore_eos=True))
    engine.reset()
    one = engine.planner.footprint(args.context + args.tokens)
    engine.set_budget(one.weights + one.working + one.transient + 2 * one.kv + one.reserve)
    return engine


def _batched(engine, prompts: list[list[int]], sampling, preempt: bool) -> dict:
    from bench.loop import run_all
    from justfit.engine.scheduler import Scheduler, plan_sequence

    engine.reset()
    runner = Scheduler(engine, max_batch=len(prompts), preempt=preempt, serve=False)
    seqs, got, most = [plan_sequence(engine, p, sampling) for p in prompts], {}, 0
    start = time.perf_counter()
    for seq, chunk in run_all(runner, seqs):
        most = max(most, len(runner.live) + (seq not in runner.live))  # it may have just left
        if chunk is not None and chunk.token is not None:
            got.setdefault(id(seq), []).append(chunk.token)
    wall = time.perf_counter() - start
    engine.reset()
    return {"preempt": preempt, "wall_s": round(wall, 2), "most_running": most, "preemptions": runner.preemptions,
            "swap_s": round(runner.swap_s, 3), "tokens": [got.get(id(s), []) for s in seqs],
            "per_sequence": [{"preemptions": s.stats.preemptions, "preempted_s": round(s.stats.preempted_s, 2),
                              "swap_s": round(s.stats.swap_s, 3)} for s in seqs]}


def preempt_rows(args) -> list[dict]:
    """The alone reference and the two batched runs, each row printed as it ends."""
    from justfit import SamplingParams

    engine = _engine(args)
    sampling = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    text = prompt_tokens(engine.tokenizer, args.context + 97 * args.sequences)
    prompts = [text[97 * i:97 * i + args.context] for i in range(args.sequences)]  # distinct prompts
    alone, start = [], time.perf_counter()
    for p in prompts:
        engine.reset()
        alone.append([c.token for c in engine.generate(p, sampling) if c.token is not None])
    engine.reset()
    base = {"context": args.context, "tokens": args.tokens, "sequences": args.sequences,
            "budget_bytes": engine.budget.bytes, "policy": engine.policy.name}
    rows = [{**base, "mode": "alone, one after another", "wall_s": round(time.perf_counter() - start, 2)}]
    print(json.dumps(rows[-1]), flush=True)
    for preempt in (True, False):
        r = _batched(engine, prompts, sampling, preempt)
        tokens = r.pop("tokens")
        rows.append({**base, "mode": "batched, preempt" if preempt else "batched, no preempt", **r,
                     "identical_to_alone": tokens == alone, "completed": sum(len(t) == args.tokens for t in tokens)})
        print(json.dumps(rows[-1]), flush=True)
    return rows

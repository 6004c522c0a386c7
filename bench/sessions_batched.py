"""bench.sessions --batched: the same sessions, turns and budget, each round's turns run
at once through the batch (justfit.engine.scheduler with preemption) instead of one after another.

Every round gives each session with room its next turn; the turns join the batch while
they fit the budget together and the newest are parked on disk when the batch would
outgrow it. Reported beside the round-robin row: the aggregate decode rate over the
active interval, preemptions and swap seconds (sequences parked mid-turn), stored
states spilled and restored between turns, and whether each turn's greedy tokens
equal the round-robin run's.
"""

from __future__ import annotations

import time


def run_batched(model: str, budget: int, single: int, text: list[int], turn: int, reply: int, sessions: int,
                state_dir: str, reference: list[tuple[str, list[int], list[int]]]) -> dict:
    """The batched row; `reference`: the round-robin run's (session, prompt, reply) per turn."""
    from justfit import Engine, SamplingParams
    from bench.loop import run_all
    from justfit.engine.scheduler import Scheduler, plan_sequence
    from justfit.config import EngineConfig

    engine = Engine(model, budget=budget, config=EngineConfig(state_dir=state_dir))
    runner = Scheduler(engine, max_batch=sessions, serve=False)
    sp = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    held: dict[str, list[int]] = {f"s{i + 1}": [] for i in range(sessions)}
    source = {name: 2 * i * single for i, name in enumerate(held)}
    replies, ttfts = [], []
    began = time.perf_counter()
    while True:
        waiting = []
        for name in held:
            new = min(turn, single - len(held[name]) - reply - 1)
            if new >= 16:
                waiting.append(plan_sequence(engine, held[name] + text[source[name]:source[name] + new], sp, name))
                source[name] += new
        if not waiting:
            break
        out, start = {}, time.perf_counter()
        for seq, chunk in run_all(runner, waiting):
            if chunk is not None and chunk.token is not None:
                if id(seq) not in out:
                    ttfts.append(time.perf_counter() - start)
                out.setdefault(id(seq), []).append(chunk.token)
        for s in waiting:
            replies.append((s.session, s.tokens, out.get(id(s), [])))
            held[s.session] = s.tokens + out.get(id(s), [])[:-1]  # the last token is sampled, not fed
    active = time.perf_counter() - began
    engine.flush_sessions()
    ref = {(n, tuple(p)): o for n, p, o in reference}
    same = sum(ref.get((n, tuple(p))) == o for n, p, o in replies)
    return {"system": "justfit-batched", "sessions": sessions, "model": model, "budget": budget,
            "single_session_ceiling": single, "active_s": round(active, 1),
            "aggregate_decode_tps": round(reply * len(replies) / active, 2),
            "retained": {n: len(t) for n, t in held.items()}, "aggregate": sum(len(t) for t in held.values()),
            "preemptions": runner.preemptions, "swap_s": round(runner.swap_s, 2),
            "swaps_to_disk": engine.states.spilled, "restores_from_disk": engine.states.restored,
            "swap_share_of_wall": round(runner.swap_s / active, 4) if active else None,
            "ttft_median_s": round(sorted(ttfts)[len(ttfts) // 2], 3) if ttfts else None,
            "turns": len(replies), "turns_identical_to_round_robin": f"{same}/{len(replies)}"}

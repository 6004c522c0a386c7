"""Named sessions across a restart: time to first token for the next turn of a
`context`-token session after the engine restarts on the same state directory, vs a
cold prefill of the same prompt; and what write-through costs a turn.

    python -m bench.state --restart --model smollm2 --context 8192

Three fresh processes: (1) runs the session's turns (the history, then one more
turn) with write-through timed; exits; (2) restarts on the same state directory and
answers the next turn (TTFT); (3) prefills the same prompt cold, in an empty state
directory.
"""

from __future__ import annotations

import json
import os
import time

from bench.common import run_worker

SESSION = "bench-session"
FOLLOW = " Now summarize the above in one sentence."


def run(model: str, context: int, scratch: str, timeout: float = 1800) -> dict:
    state = os.path.join(scratch, "state")
    first = run_worker("bench.state_restart", ["turns", model, str(context), state], timeout)
    if "error" in first:
        return {"error": f"turns: {first['error']}"}
    restarted = run_worker("bench.state_restart", ["resume", model, str(context), state], timeout)
    cold = run_worker("bench.state_restart", ["cold", model, str(context), os.path.join(scratch, "cold")], timeout)
    if "error" in restarted or "error" in cold:
        return {"error": f"resume: {restarted.get('error')}, cold: {cold.get('error')}"}
    return {"model": model, "context": context, **first, **restarted, **cold,
            "restart_speedup": cold["ttft_cold_s"] / restarted["ttft_restart_s"]}


def _engine(model: str, state: str):
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core
    from justfit import Engine
    from justfit.config import EngineConfig

    return Engine(model, config=EngineConfig(state_dir=state))


def _timed_puts(engine) -> list[float]:
    """Seconds each `StateTiers.put` takes on the engine thread (for a session: the
    capture and queueing of its write-through, waiting for the previous one)."""
    spent: list[float] = []
    put = engine.states.put

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return put(*a, **kw)
        finally:
            spent.append(time.perf_counter() - start)

    engine.states.put = timed
    return spent


def _turn(engine, tokens: list[int], max_tokens: int, session: str | None) -> tuple[float, float, object]:
    """(TTFT, wall time, the request's stats) of one turn."""
    from justfit import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = stats = None
    for chunk in engine.generate(tokens, sp, session=session):
        first = first if first is not None else time.perf_counter() - start
        stats = chunk.stats or stats  # the last chunk carries them
    return first, time.perf_counter() - start, stats


def worker(mode: str, model: str, context: int, state: str) -> dict:
    from bench.common import prompt_tokens

    engine = _engine(model, state)
    if mode == "turns":
        history = prompt_tokens(engine.tokenizer, context)
        puts = _timed_puts(engine)
        _, wall1, _ = _turn(engine, history, 16, SESSION)
        writer = engine.states.writer
        follow = engine.states.entries[engine.states.sessions[SESSION]].tokens + list(engine.tokenizer.encode(FOLLOW))
        _, wall2, _ = _turn(engine, follow, 16, SESSION)
        start = time.perf_counter()
        engine.flush_sessions()
        flush = time.perf_counter() - start
        e = engine.states.entries[engine.states.sessions[SESSION]]
        return {"turn1_wall_s": wall1, "turn2_wall_s": wall2, "turn1_put_s": puts[0], "turn2_put_s": puts[1],
                "write_through_blocking_pct": 100 * (puts[0] + puts[1]) / (wall1 + wall2),
                "turn2_blocking_pct": 100 * puts[1] / wall2, "writes_s": writer.seconds,
                "turn2_write_s": writer.last_seconds, "final_flush_s": flush,
                "turn2_write_pct_of_turn2": 100 * writer.last_seconds / wall2,
                "session_tokens": len(e.tokens), "session_bytes": e.disk_bytes}
    tokens = None
    if mode == "resume":
        e = engine.states.entries[engine.states.sessions[SESSION]]
        tokens = e.tokens + list(engine.tokenizer.encode(" And in one word?"))
        ttft, _, s = _turn(engine, tokens, 1, SESSION)
        return {"ttft_restart_s": ttft, "restart_cached_tokens": s.cached_tokens,
                "restart_prefilled_tokens": s.prompt_tokens - s.cached_tokens, "restart_source": s.restored_from,
                "restart_restore_s": s.restore_s, "prompt_tokens": len(tokens)}
    history = prompt_tokens(engine.tokenizer, context)  # cold: the same length of prompt, nothing stored
    ttft, _, s = _turn(engine, history + list(engine.tokenizer.encode(FOLLOW)) + list(engine.tokenizer.encode(" x" * 16)),
                       1, None)
    return {"ttft_cold_s": ttft, "cold_cached_tokens": s.cached_tokens}


if __name__ == "__main__":
    import sys

    args = sys.argv[sys.argv.index("--worker") + 1:]
    print(json.dumps(worker(args[0], args[1], int(args[2]), args[3])))

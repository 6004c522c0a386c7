"""Sessions under one memory budget: each of `--sessions` (2 or 4) grows turn by turn
to what a single session can hold in that budget; those not running are swapped to disk.

    python -m bench.sessions --model smollm2 --positions 6144
    python -m bench.sessions --model smollm2 --positions 3072 --sessions 4
    python -m bench.sessions --budget 150MiB --sessions 4 --turn 512
    python -m bench.sessions --quick              # 2 sessions, budget set by 512 positions: minutes
    python -m bench.sessions --quick --batched    # and the same turns at once through the batch

Turns go round-robin (one engine computes one request at a time). The aggregate decode
rate is all sessions' generated tokens over the common active interval (first turn's
start to last turn's end), never a sum of per-request rates.
The budget is the smallest in which one session holds `--positions` (or `--budget`);
the single-session ceiling is the planner's, with layer offloading allowed, so the ratio
(aggregate retained positions / ceiling) is against the most one session could hold.
Besides the aggregate (N sessions swapped to disk hold N single sessions' positions
by construction), each run reports what is not: the share of wall time spent swapping
(states written out and read back in), the TTFT of a turn swapped in from disk vs one
whose state stayed in memory, and the decode rate vs session s1's turns run alone.
Verification (default on) replays every turn in an engine without a budget, where
every session stays in memory and nothing streams, and compares the greedy tokens:
turns whose KV pages all kept the configured format must match (swaps to disk and
offloaded layers change nothing); pages that stepped down KVExec's pressure ladder are
lossy by design, so those turns are counted apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace


# 512 positions set a budget whose single-session ceiling (~1.7K on SmolLM2) is memory's,
# not the trained context's, and that 2 sessions reach in a few minutes.
QUICK = {"positions": 512, "turn": 256, "reply": 8}


def ceiling(engine) -> int:
    """The most positions one request may hold in the engine's budget."""
    from justfit.errors import BudgetExceeded, ContextTooLong

    lo, hi = 0, engine.context_limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            engine.planner.check_fits(mid, 0)
            lo = mid
        except (BudgetExceeded, ContextTooLong):
            hi = mid
    return lo


def run(model: str, positions: int, budget: int | None, turn: int, reply: int, verify: bool,
        sessions: int = 2, batched: bool = False) -> dict:
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core

    with tempfile.TemporaryDirectory(prefix="justfit-sessions-") as state_dir:  # swapped states go here
        return _run(model, positions, budget, turn, reply, verify, sessions, state_dir, batched)


def _run(model: str, positions: int, budget: int | None, turn: int, reply: int, verify: bool, sessions: int,
         state_dir: str, batched: bool = False) -> dict:
    import mlx.core as mx

    from bench.common import progress_bar, prompt_tokens
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig
    from justfit.engine.stats import collect

    if budget is None:
        probe = Engine(model, config=EngineConfig(state_dir=state_dir))
        budget = probe.planner.footprint(positions, tuple(probe.swap.offload_order())).total
        del probe
    engine = Engine(model, budget=budget, config=EngineConfig(state_dir=state_dir))
    spill_s = _time_spills(engine)
    single = ceiling(engine)
    text = prompt_tokens(engine.tokenizer, 2 * sessions * single)
    sp = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    held: dict[str, list[int]] = {f"s{i + 1}": [] for i in range(sessions)}
    source = {name: 2 * i * single for i, name in enumerate(held)}  # each reads its own stretch of text
    began = time.perf_counter()
    turns, replies = [], []
    bar = progress_bar(sessions * single, f"{sessions} sessions", "pos")
    while True:
        ran = False
        for name in held:
            room = single - len(held[name]) - reply - 1
            new = min(turn, room)
            if new < 16:
                continue
            prompt = held[name] + text[source[name]:source[name] + new]
            source[name] += new
            mx.reset_peak_memory()
            start = time.perf_counter()
            gen = engine.generate(prompt, sp, session=name)
            first = next(gen)
            ttft = time.perf_counter() - start
            rest = collect(gen)
            out = [first.token] + rest.tokens
            s = rest.stats or first.stats
            held[name] = engine.cached_tokens
            replies.append((name, prompt, out))
            turns.append({"session": name, "prompt_tokens": len(prompt), "new_tokens": new,
                          "cached_tokens": s.cached_tokens, "restored_from": s.restored_from,
                          "restore_s": round(s.restore_s, 3), "ttft_s": round(ttft, 3),
                          "decode_tps": round(s.decode_tps, 2), "decode_s": s.decode_s, "mlx_peak": s.memory.mlx_peak,
                          "stored_states_in_memory": engine.states.memory_bytes,
                          "offloaded": len(engine.swap.offloaded), "retained_after": len(held[name]),
                          "kv_formats": s.kv_formats, "prefill_chunk": s.prefill_chunk})
            bar.update(sum(len(t) for t in held.values()) - bar.n)
            bar.set_postfix_str(f"{name}: ttft {ttft:.2f} s, restored from {s.restored_from or 'nothing'}")
            ran = True
        if not ran:
            break
    bar.close()
    active = time.perf_counter() - began
    aggregate = sum(len(t) for t in held.values())
    generated = reply * len(turns)
    row = {"system": "justfit-default", "sessions": sessions, "model": model, "budget": budget,
           "single_session_ceiling": single, "active_s": round(active, 1),
           "aggregate_decode_tps": round(generated / active, 2),
           "decode_only_tps": round(generated / sum(t["decode_s"] for t in turns), 2),
           "retained": {n: len(t) for n, t in held.items()}, "aggregate": aggregate,
           "ratio": aggregate / single, "both_at_once_fits": ceiling(engine) >= aggregate,
           "max_mlx_peak": max(t["mlx_peak"] for t in turns), "swaps_to_disk": engine.states.spilled,
           "restores_from_disk": engine.states.restored, "turns": turns}
    row.update(_not_by_construction(turns, active, spill_s[0]))
    engine.flush_sessions()  # the writer is done before the folder goes
    row.update(_alone(model, budget, [(p, o) for n, p, o in replies if n == "s1"], sp, state_dir, row))
    if verify:
        # The same weights form (a budget may have chosen cpu-compact), no budget.
        free = Engine(model, config=EngineConfig(policy=engine.policy.name, state_dir=os.path.join(state_dir, "free")))
        base = engine.config.kv.format if engine.config.kv else None
        for t, (name, prompt, out) in zip(turns, replies):
            # The budget may have shrunk the prefill chunk, which decides which keys a
            # chunk's queries see in full precision: the replay uses the same one.
            free.parts = free.parts.reconfigured(replace(free.config, prefill_chunk=t["prefill_chunk"]
                                                         or engine.config.prefill_chunk))
            t["identical"] = [c.token for c in free.generate(prompt, sp, session=name) if c.token is not None] == out
        free.flush_sessions()
        # Pages that stepped down KVExec's pressure ladder are lossy by design; the
        # rest (swaps to disk, offloaded layers) must change nothing.
        kept = [t for t in turns if set(t["kv_formats"]) <= {base}]
        row["turns_identical_to_unbudgeted"] = f"{sum(t['identical'] for t in turns)}/{len(turns)}"
        row["identical_where_pages_kept_their_format"] = f"{sum(t['identical'] for t in kept)}/{len(kept)}"
    if batched:  # the same turns at once through the batch (bench.sessions_batched), beside this row
        from bench.sessions_batched import run_batched

        row["batched"] = run_batched(model, budget, single, text, turn, reply, sessions,
                                     os.path.join(state_dir, "batched"), replies)
    return row


def _time_spills(engine) -> list[float]:
    """Seconds the engine spends writing states out (swap-out), accumulated in the
    returned one-item list as it runs."""
    spent = [0.0]
    spill = engine.states.spill

    def timed(entry):
        start = time.perf_counter()
        try:
            return spill(entry)
        finally:
            spent[0] += time.perf_counter() - start

    engine.states.spill = timed  # this engine's tiers only
    return spent


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return round(xs[len(xs) // 2], 3) if xs else None


def _not_by_construction(turns: list[dict], active: float, spill_s: float) -> dict:
    """What the aggregate does not show: the share of wall time spent swapping (states
    written out, and read back in), and the TTFT of a turn swapped in from disk next to
    one whose state stayed in memory (same new tokens per turn)."""
    swap_in = sum(t["restore_s"] for t in turns if t["restored_from"] == "disk")
    disk = [t["ttft_s"] for t in turns if t["restored_from"] == "disk"]
    resident = [t["ttft_s"] for t in turns if t["restored_from"] != "disk" and t["cached_tokens"]]
    return {"swap_out_s": round(spill_s, 4), "swap_in_s": round(swap_in, 4),
            "swap_share_of_wall": round((spill_s + swap_in) / active, 4) if active else None,
            "ttft_swapped_in_s": _median(disk), "ttft_resident_s": _median(resident),
            "turns_swapped_in": len(disk), "turns_resident": len(resident)}


def _alone(model: str, budget: int, turns: list[tuple[list[int], list[int]]], sp, state_dir: str,
           row: dict) -> dict:
    """Session s1's turns replayed with no other session, same budget: its decode rate
    beside the shared run's (decode time only, both)."""
    from justfit import Engine
    from justfit.config import EngineConfig

    alone = Engine(model, budget=budget, config=EngineConfig(state_dir=os.path.join(state_dir, "alone")))
    generated = decode_s = 0.0
    for prompt, _ in turns:
        r = alone.reply(prompt, sp, session="s1")
        generated += len(r.tokens)
        decode_s += r.stats.decode_s
    alone.flush_sessions()
    rate = generated / decode_s if decode_s else None
    return {"alone_decode_tps": round(rate, 2) if rate else None,
            "decode_vs_alone": round(row["decode_only_tps"] / rate, 3) if rate else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--positions", type=int, default=6144, help="what one session should hold (sets the budget)")
    ap.add_argument("--budget", default=None, help="use this budget instead (e.g. 200MiB)")
    ap.add_argument("--turn", type=int, default=1024, help="new prompt tokens per turn")
    ap.add_argument("--reply", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--batched", action="store_true",
                    help="also run each round's turns at once through the batch (a second row)")
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    args = ap.parse_args(argv)
    from bench.common import apply_quick, machine_info
    from bench.report import publish
    from justfit.memory import parse_size

    apply_quick(args, QUICK, argv)
    budget = parse_size(args.budget) if args.budget else None
    row = run(args.model, args.positions, budget, args.turn, args.reply, args.verify, args.sessions, args.batched)
    rows = [row] + ([row.pop("batched")] if "batched" in row else [])
    if not args.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "turns"}), file=sys.stderr)
    result = {"machine": machine_info(), "systems": rows}
    publish("sessions", result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

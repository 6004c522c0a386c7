"""Crash safety of stored states, tested by killing: workers (forked from a zygote)
run named sessions' turns and anonymous requests on one state directory and are
SIGKILLed at random points (prefill, decode, spill, write, fsync, publish, cleanup,
or a random moment); after each kill a new process must find every session at its
last completed turn or the one before, byte-exact against a replay, every stored
state readable, and no temporaries left. `--long` runs 200+ injections and a few on
SmolLM2 (tests/conftest.py)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from kvexec.disk_pages import sweep
from tests.helpers.state_harness import Replay, Zygote, allowed_turns, check, log_lines, wait_for

NAMES = ["a", "b"]
TURNS = 5
POINTS = ["write", "fsync", "publish", "published", "cleanup", "spill"]
MODES = ["timer", "prefill", "decode"] + POINTS


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _spec(model, state, rng: random.Random, extra: dict) -> dict:
    mode = rng.choice(MODES)
    spec = {**extra, "model": str(model), "state": str(state), "sessions": NAMES, "turns": TURNS, "steps": 40,
            "anon_every": rng.choice([0, 2, 3]), "memory": rng.choice([0, None]), "seed": rng.randrange(1 << 30),
            "disk": rng.choice([1 << 40, 1 << 16])}
    if mode in ("prefill", "decode"):
        spec["die"], spec["die_step"] = [mode, rng.randrange(1, 4)], rng.randrange(0, 6)
    elif mode != "timer":
        spec["fault"] = f"{mode}:{rng.randrange(1, 6)}"
    return spec | {"mode": mode}


def inject(zygote: Zygote, model, tmp_path, injections: int, seed: int, max_runs: int, extra: dict | None = None) -> dict:
    """Run workers until `injections` of them were killed; check after each run
    (`extra`: more of the workers' engine spec, tests/helpers/state_crash_child.py)."""
    rng = random.Random(seed)
    state = tmp_path / "state"
    extra = extra or {}
    replay = Replay({"model": str(model), **extra}, NAMES, TURNS, tmp_path / "replay")
    turns = {n: 0 for n in NAMES}
    outcome = {"kills": 0, "runs": 0, "by_mode": {}, "at_last_turn": 0, "previous_turn": 0, "in_flight_turn": 0}
    while outcome["kills"] < injections and outcome["runs"] < max_runs:
        spec = _spec(model, state, rng, extra)
        log = tmp_path / f"run{outcome['runs']}.log"
        pid = zygote.fork(spec, log)
        if spec["mode"] == "timer":
            wait_for(log, "ready")
            time.sleep(rng.uniform(0.0, 1.5))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = zygote.wait(pid)
        lines = log_lines(log)
        assert not any(w[0] == "error" for w in lines), lines
        outcome["runs"] += 1
        killed = status["signal"] == signal.SIGKILL
        if killed:
            outcome["kills"] += 1
            outcome["by_mode"][spec["mode"]] = outcome["by_mode"].get(spec["mode"], 0) + 1
        allowed = {n: allowed_turns(turns[n], lines, n) for n in NAMES}
        found = check(replay, state, allowed)
        if killed:
            for n in NAMES:
                last = turns[n]  # the last turn the worker reported complete
                for w in lines:
                    if w[1:2] == [n] and w[0] in ("done", "dropped"):
                        last = int(w[2]) if w[0] == "done" else 0
                key = "at_last_turn" if found[n] == last else "in_flight_turn" if found[n] > last else "previous_turn"
                outcome[key] += 1
        turns = found
    return outcome


def test_sessions_survive_sigkill_at_random_points(zygote, tiny_llama_dir, tmp_path, request):
    long = request.config.getoption("--long")
    outcome = inject(zygote, tiny_llama_dir, tmp_path, 200 if long else 20, seed=17, max_runs=400 if long else 40)
    print("kill injections:", outcome)
    assert outcome["kills"] >= (200 if long else 20)


def test_sessions_with_pages_on_disk_survive_sigkill(zygote, tiny_llama_dir, tmp_path, request):
    # killed while pages are read back or written (prefill, decode) and while a turn is
    # published (its snapshot linking the page file): the sessions are whole snapshots as ever
    long = request.config.getoption("--long")
    outcome = inject(zygote, tiny_llama_dir, tmp_path, 40 if long else 8, seed=23, max_runs=80 if long else 16,
                     extra={"kv_disk": str(tmp_path / "kv")})
    print("kill injections, pages on disk:", outcome)
    assert outcome["kills"] >= (40 if long else 8)
    # what a killed process left in the KV folder is its page file's name, which the next
    # engine there removes (no owner holds its lock); the sessions keep their links
    sweep(tmp_path / "kv")
    assert not os.listdir(tmp_path / "kv")


@pytest.mark.skipif("not config.getoption('--long')", reason="long variant: --long")
def test_smollm2_sessions_survive_sigkill(zygote, smollm2_gguf, tmp_path):
    outcome = inject(zygote, smollm2_gguf, tmp_path, 6, seed=5, max_runs=12)
    print("SmolLM2 kill injections:", outcome)
    assert outcome["kills"] >= 6

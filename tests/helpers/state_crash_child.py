"""The worker side of the state crash tests: a zygote process that imports the engine
once and forks a fresh worker per run (a new process in milliseconds, not seconds),
and the worker's script: named sessions' turns, anonymous requests, and optional
self-inflicted SIGKILLs (in prefill or decode) or StateTrans fault points.

The schedule is deterministic, so a test replays it in-process and compares what a
crashed worker left on disk byte for byte. Run `python -m tests.helpers.state_crash_child`
(the zygote: JSON commands on stdin, replies on stdout).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

WORDS = 12  # new tokens per user turn
REPLY = 4  # tokens generated per turn (ignore_eos)
STEP = WORDS + REPLY - 1  # tokens a session's state gains per turn


def turn_words(name: str, turn: int) -> list[int]:
    """A session's new tokens at `turn` (from 1); the first token names the session,
    so no session shares a prefix with another or with anonymous requests."""
    rng = random.Random(f"{name}:{turn}")
    head = [3 + sum(map(ord, name)) % 60] if turn == 1 else []
    return head + [rng.randrange(70, 250) for _ in range(WORDS - len(head))]


def anon_words(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(250, 256)] + [rng.randrange(70, 250) for _ in range(23)]


def engine_for(spec: dict):
    from justfit import Engine
    from justfit.config import EngineConfig
    from kvexec import KVConfig

    kv = KVConfig(format="fp16", page_size=16, hot_window=16, block_tokens=64) if spec.get("paged", True) else None
    # "kv_disk": every layer's full pages on disk in that folder, read back just in time
    pages = {"kv_disk": spec["kv_disk"], "kv_disk_layers": 1 << 10} if spec.get("kv_disk") else {}
    return Engine(spec["model"], config=EngineConfig(kv=kv, prefill_chunk=16, state_dir=spec["state"],
                                                     state_memory=spec.get("memory"),
                                                     # "disk": what anonymous states may hold; sessions unbounded
                                                     state_disk=spec.get("disk", 1 << 40) + (1 << 40),
                                                     session_disk=1 << 40, **pages))


def sampling():
    from justfit import SamplingParams

    return SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True)


def session_tokens(engine, name: str) -> list[int]:
    e = engine.states.index.session(name)
    return list(e.tokens) if e is not None else []


def run_turn(engine, name: str, turn: int, die: tuple[str, int] | None = None) -> None:
    """One turn of session `name`, dying (SIGKILL) at the `die` point if given."""
    prompt = session_tokens(engine, name) + turn_words(name, turn)
    seen = {"prefill": 0, "decode": 0}

    def tick(kind: str) -> None:
        seen[kind] += 1
        if die is not None and die[0] == kind and seen[kind] >= die[1]:
            os.kill(os.getpid(), signal.SIGKILL)

    for _ in engine.generate(prompt, sampling(), progress=lambda done, total: tick("prefill"), session=name):
        tick("decode")


def work(spec: dict, log) -> None:
    """The worker's script (see the module docstring); prints progress lines to `log`."""
    def say(*words) -> None:
        log.write(" ".join(str(w) for w in words) + "\n")
        log.flush()

    if spec.get("fault"):  # a StateTrans crash point, installed in this worker only
        from statetrans import faults

        faults.install(faults.Faults.parse(spec["fault"]))
    engine = engine_for(spec)
    say("ready", os.getpid())
    rng = random.Random(spec.get("seed", 0))
    die = tuple(spec["die"]) if spec.get("die") else None
    die_at = spec.get("die_step", 0)
    for step in range(spec.get("steps", 1000)):
        if spec.get("anon_every") and step % spec["anon_every"] == spec["anon_every"] - 1:
            list(engine.generate(anon_words(rng.randrange(1 << 30)), sampling()))
            say("anon")
        name = spec["sessions"][step % len(spec["sessions"])]
        turn = len(session_tokens(engine, name)) // STEP
        if turn >= spec.get("turns", 6):
            say("drop", name)
            engine.drop_session(name)
            say("dropped", name)
            continue
        say("start", name, turn + 1)
        run_turn(engine, name, turn + 1, die if step >= die_at else None)
        say("done", name, turn + 1)
        if spec.get("hold") and step + 1 == spec.get("hold_after", 0):
            say("holding")
            while not os.path.exists(spec["hold"]):
                time.sleep(0.02)
    engine.flush_sessions()
    say("finished")


def zygote() -> None:
    """Fork a worker per `{"cmd": "fork", "spec": ..., "log": PATH}`; reap one per
    `{"cmd": "wait", "pid": N}` (replying its exit status)."""
    from justfit import runtime

    runtime.setup()  # OpenBLAS, then mlx: imported once, computed nothing yet
    import justfit.engine.facade  # noqa: F401

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "fork":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    with open(cmd["log"], "a") as log:
                        work(cmd["spec"], log)
                except BaseException as e:  # reported, for the test to show
                    with open(cmd["log"], "a") as log:
                        log.write(f"error {type(e).__name__}: {e}\n")
                    code = 1
                os._exit(code)
            reply = {"pid": pid}
        else:
            _, status = os.waitpid(cmd["pid"], 0)
            reply = {"pid": cmd["pid"], "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                     "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    zygote()

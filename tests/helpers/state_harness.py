"""The test side of the crash harness: drives the zygote (tests/helpers/state_crash_child.py),
replays the deterministic schedule in-process, and checks what a killed worker left
on disk against the replay, byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from statetrans.disk import temp_owner
from statetrans.faults import Faults
from statetrans.state import capture, copy_arrays
from statetrans.tiers import StateTiers
from tests.helpers.state_crash_child import STEP, engine_for, run_turn

ROOT = Path(__file__).resolve().parents[2]


class Zygote:
    """A process that forks workers on request (see tests/helpers/state_crash_child.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.state_crash_child"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote died")
        return json.loads(line)

    def fork(self, spec: dict, log: Path) -> int:
        return self._ask({"cmd": "fork", "spec": spec, "log": str(log)})["pid"]

    def wait(self, pid: int) -> dict:
        return self._ask({"cmd": "wait", "pid": pid})

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def wait_for(log: Path, word: str, timeout: float = 60.0) -> list[list[str]]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lines = log_lines(log)
        if any(w and w[0] in (word, "error") for w in lines):
            return lines
        time.sleep(0.01)
    raise TimeoutError(f"no {word!r} in {log}")


class Replay:
    """Each session's tokens and state arrays after each turn, computed in-process."""

    def __init__(self, spec: dict, names: list[str], turns: int, scratch: Path):
        engine = engine_for({**spec, "state": str(scratch), "memory": None})
        self.engine = engine
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.arrays: dict[tuple[str, int], dict] = {}
        for name in names:
            for turn in range(1, turns + 1):
                run_turn(engine, name, turn)
                e = engine.states.index.session(name)
                self.tokens[name, turn] = list(e.tokens)
                self.arrays[name, turn] = copy_arrays(capture(e.cache)[0])
        engine.states.flush()

    def fresh_tiers(self, state_dir: Path) -> StateTiers:
        """What a new process finds in `state_dir` (it also sweeps dead temporaries)."""
        s = self.engine.states
        return StateTiers(state_dir, s.identity, s.layers, 1 << 40, 1 << 40, Faults())


def allowed_turns(base: int, lines: list[list[str]], name: str) -> set[int]:
    """The turns session `name` may be found at after a worker that started with it
    at turn `base` printed `lines` and was killed: its last completed turn or the one
    before, or the one in flight if it completed unreported; 0 (absent) while
    dropped."""
    done = started = base
    dropping = False
    for words in lines:
        if words[1:2] != [name]:
            continue
        if words[0] == "start":
            started = int(words[2])
        elif words[0] == "done":
            done = int(words[2])
        elif words[0] == "drop":
            dropping = True
        elif words[0] == "dropped":
            dropping, done, started, base = False, 0, 0, 0
    allowed = {done, max(base, done - 1)}
    if started == done + 1:
        allowed.add(started)
    if dropping:
        allowed.add(0)
    return allowed


def debris(state_dir: Path) -> list[Path]:
    """Temporaries anywhere under `state_dir`."""
    return [p for p in state_dir.rglob("*") if temp_owner(p.name) is not None]


def check(replay: Replay, state_dir: Path, allowed: dict[str, set[int]]) -> dict[str, int]:
    """Open `state_dir` as a new process would and check every session against the
    replay (byte-exact) and every anonymous state readable; returns the turns found."""
    tiers = replay.fresh_tiers(state_dir)
    assert debris(state_dir) == [], "temporaries left after a restart"
    found = {}
    for name, ok in allowed.items():
        e = tiers.index.session(name)
        turn = len(e.tokens) // STEP if e is not None else 0
        assert turn in ok, f"session {name} at turn {turn}, expected one of {sorted(ok)}"
        found[name] = turn
        if e is None:
            continue
        assert e.tokens == replay.tokens[name, turn], f"session {name}: tokens differ from the replay"
        cache, _, _ = tiers.read(e.path)
        got, want = capture(cache)[0], replay.arrays[name, turn]
        assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]) for k in want), \
            f"session {name} turn {turn}: state differs from the replay"
    for e in list(tiers.entries.values()):
        if e.session is None:
            tiers.read(e.path)  # never a corrupt anonymous state either (raises SnapshotError)
    return found

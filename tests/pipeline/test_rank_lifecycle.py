"""A layer pipeline stops as one (justfit/pipeline/launch.py, cli/common.py): `justfit serve
--ranks 2` on a tiny model, stopped by a signal to its top process (SIGTERM, SIGINT,
SIGHUP), to its whole process group (systemd's way), by Ctrl-C on its terminal, or
killed (SIGKILL: no handler runs, as in a crash), or losing a follower. Every time,
within a few seconds, no process of the group is left (by the pids recorded and by
command line) and the port is closed; a stop signal lets the stream in flight finish
on every rank, and the exit status is 0.

`--long` adds SIGHUP and repeats SIGTERM and SIGKILL JUSTFIT_STOP_CYCLES times (default
200), the other cases a tenth as many."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from justfit.pipeline.launch import LAUNCHER_PIPE
from tests.helpers.rank_group import ROOT, ServeGroup

GONE_S = 5.0  # every process gone within this of a kill, or of the end of the drain
DRAIN_S = 10.0  # `justfit serve --drain`'s default
LONG_CYCLES = int(os.environ.get("JUSTFIT_STOP_CYCLES", "200"))
GRACEFUL = ("sigterm", "sigint", "sighup", "group-sigterm", "ctrl-c")


def cycle(model: Path, tmp_path: Path, case: str) -> tuple[float, float]:
    """Start a group, stream a request, do `case` once its first token is back; check
    what is left and how the stream ended. Seconds from the signal until all was gone,
    and from the end of the drain (the stream's end) until all was gone."""
    group = ServeGroup(model, tmp_path / "serve.log", terminal=case == "ctrl-c")
    try:
        group.wait_serving()
        stream = group.stream(200)
        assert stream.first.wait(30) and stream.tokens, stream.error
        before = stream.tokens
        start = time.monotonic()
        if case == "ctrl-c":
            group.ctrl_c()
        elif case == "group-sigterm":
            os.killpg(group.proc.pid, signal.SIGTERM)
        elif case == "follower-sigkill":
            os.kill(group.rank_pids()[1], signal.SIGKILL)
        else:
            os.kill(group.proc.pid, getattr(signal, case.upper()))
        took = group.wait_gone(start, timeout=60)
        stream.join(30)
        assert not group.port_open()
        status = group.proc.returncode
        log = group.log.read_text()[-3000:]
        if case in GRACEFUL:
            # the drain let the stream in flight finish, on every rank
            assert status == 0, log
            assert stream.ended == "done" and stream.tokens > before, (stream.ended, stream.error, log)
            assert took < DRAIN_S + GONE_S, (case, took)
        elif case == "follower-sigkill":
            # the request in flight fails (the pipeline is lost), the launcher ends the group
            assert status == 128 + signal.SIGKILL, log
            assert stream.ended in ("error", "cut"), stream.ended
        else:
            assert status == -getattr(signal, case.upper())
        after = start + took - max(start, stream.at)
        assert after < GONE_S, (case, took, after)
        return took, after
    finally:
        group.close()


CASES = ["sigterm", "sigint", "sighup", "group-sigterm", "ctrl-c", "sigkill", "follower-sigkill"]
SHORT = [c for c in CASES if c != "sighup"]  # SIGHUP takes SIGTERM's path through the launcher: --long only


@pytest.mark.parametrize("case", SHORT)
def test_the_group_stops_as_one(case, tiny_llama_dir, tmp_path):
    took, after = cycle(tiny_llama_dir, tmp_path, case)
    print(f"{case}: all gone {took:.2f} s after the signal, {after:.2f} s after the stream's end")


def test_a_stop_signal_while_the_ranks_load_ends_them_all(tiny_llama_dir, tmp_path):
    """Before rank 0 serves, a stop ends it at once; the others, still connecting, are
    killed then: nothing waits for a rank that will never come."""
    group = ServeGroup(tiny_llama_dir, tmp_path / "serve.log")
    try:
        group.wait_ranks()
        start = time.monotonic()
        os.kill(group.proc.pid, signal.SIGTERM)
        took = group.wait_gone(start)
        assert group.proc.returncode == 128 + signal.SIGTERM and took < GONE_S, (group.proc.returncode, took)
        assert "serving " not in group.log.read_text()
    finally:
        group.close()


@pytest.mark.skipif("not config.getoption('--long')", reason="long variant: --long")
@pytest.mark.parametrize("case", CASES)
def test_the_group_stops_as_one_every_time(case, tiny_llama_dir, tmp_path):
    """JUSTFIT_STOP_CYCLES times SIGTERM and SIGKILL (the targets' injections), a tenth
    as many of the other cases."""
    n = LONG_CYCLES if case in ("sigterm", "sigkill") else max(1, LONG_CYCLES // 10)
    runs = [cycle(tiny_llama_dir, tmp_path, case) for _ in range(n)]
    took, after = sorted(t for t, _ in runs), sorted(a for _, a in runs)
    print(f"{case} x{n}: all gone after the signal: median {took[n // 2]:.2f} s, max {took[-1]:.2f} s; "
          f"after the stream's end: median {after[n // 2]:.2f} s, max {after[-1]:.2f} s")


# -- the launcher's pipe, where PR_SET_PDEATHSIG is not -------------------------

WATCHER = str(Path(__file__).parents[1] / "helpers" / "launcher_watch_child.py")


def _watcher(rank: int, pass_pipe: bool = True):
    """A rank-like child watching a pipe this process holds, without PR_SET_PDEATHSIG."""
    r, w = os.pipe()
    env = {**os.environ, "PYTHONPATH": ROOT, "MLX_RANK": str(rank), LAUNCHER_PIPE: f"{r}:{os.fstat(r).st_ino}"}
    proc = subprocess.Popen([sys.executable, WATCHER], env=env, stdout=subprocess.PIPE, text=True,
                            pass_fds=(r,) if pass_pipe else ())
    os.close(r)
    assert proc.stdout.readline().strip() == "watching"
    return proc, w


@pytest.mark.parametrize("rank, signum", [(0, signal.SIGTERM), (1, signal.SIGKILL)])
def test_a_rank_leaves_when_the_launchers_pipe_closes(rank, signum):
    proc, w = _watcher(rank)
    try:
        time.sleep(0.3)
        assert proc.poll() is None  # the launcher is there: it stays
        start = time.monotonic()
        os.close(w)  # the launcher is gone
        assert proc.wait(10) == -signum and time.monotonic() - start < 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_process_with_only_the_launchers_environment_does_not_watch():
    """A rank's own child inherits the environment, not the pipe: the number names no
    file there (or another one), so it watches nothing and stays."""
    proc, w = _watcher(0, pass_pipe=False)
    os.close(w)
    time.sleep(0.5)
    try:
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_usage_errors_exit_2():
    for argv in ([], ["-n", "2"], ["-n", "0", "--", "true"], ["-n", "2", "--grace", "x", "--", "true"]):
        done = subprocess.run([sys.executable, "-m", "justfit.pipeline.launch", *argv], capture_output=True, text=True,
                              cwd=ROOT, timeout=30)
        assert done.returncode == 2 and "usage" in done.stderr, (argv, done.stderr)

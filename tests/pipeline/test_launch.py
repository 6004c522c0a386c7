"""Local ranks (justfit/pipeline/launch.py) and their transfers (justfit/pipeline/link.py): a rank waiting
for its neighbour sleeps, the launcher relays nothing, a failing rank ends the others, a
stop signal goes to rank 0 alone and a group that does not stop is killed after the
grace (tests/pipeline/test_rank_lifecycle.py stops `justfit serve --ranks 2`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import click

from cli.common import UserError, _option_value, _without_ranks, rank_budget
from justfit.pipeline.launch import launched

CHILD = str(Path(__file__).parents[1] / "helpers" / "launch_child.py")
SIGNAL_CHILD = str(Path(__file__).parents[1] / "helpers" / "launch_signal_child.py")
ROOT = str(Path(__file__).resolve().parents[2])


def test_a_waiting_rank_sleeps_and_the_launcher_stays_idle():
    """MLX's ring backend spins while it waits, and mlx.launch's relay never sleeps
    (each held a core here): rank 1 waits 2 s for rank 0 on its doorbell at almost no
    CPU, and the launcher, which relays nothing, uses almost none."""
    proc = subprocess.Popen(launched(2, [sys.executable, CHILD]), stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    time.sleep(1.5)
    launcher_cpu = sum(psutil.Process(proc.pid).cpu_times()[:2])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    waited = next(r for r in rows if "waited_s" in r)
    assert waited["doorbells"] and waited["waited_s"] > 0.5
    assert waited["cpu_s"] < 0.25 * waited["waited_s"], waited
    assert next(r for r in rows if "back" in r)["back"] == sum(2 * i + 1 for i in range(1024))
    assert launcher_cpu < 0.5, launcher_cpu


def test_a_failing_rank_ends_the_others_and_its_status_is_the_launchers():
    start = time.monotonic()
    done = subprocess.run(launched(2, [sys.executable, CHILD, "fail"]), capture_output=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 3 and time.monotonic() - start < 30


def _signalled(tmp_path, *args: str, grace: float | None = None) -> tuple[int, float, list[dict]]:
    """Two ranks of launch_signal_child.py, SIGTERM to the launcher once both run: its
    status, the seconds from the signal to its end, what the ranks printed."""
    out = tmp_path / "out"
    with open(out, "w") as f:
        proc = subprocess.Popen(launched(2, [sys.executable, SIGNAL_CHILD, str(tmp_path / "flag"), *args], grace),
                                stdout=f, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    try:
        end = time.monotonic() + 30
        while out.read_text().count("\n") < 2:
            assert proc.poll() is None and time.monotonic() < end, out.read_text()
            time.sleep(0.02)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(30)
        return status, time.monotonic() - start, sorted((json.loads(r) for r in out.read_text().splitlines()),
                                                        key=lambda r: r["rank"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_stop_signal_goes_to_rank_0_which_ends_the_others(tmp_path):
    """The others ignore the stop signals (a terminal or a service manager sends them to
    every process at once): they leave when rank 0 tells them, and the group exits 0."""
    status, took, rows = _signalled(tmp_path)
    assert status == 0 and took < 3, (status, took)
    assert rows[0]["ignores"] == [] and rows[1]["ignores"] == ["SIGINT", "SIGTERM", "SIGHUP"]


def test_a_group_that_does_not_stop_is_killed_after_the_grace(tmp_path):
    status, took, _ = _signalled(tmp_path, "stuck", grace=1.0)
    assert status == 128 + signal.SIGKILL and 1.0 <= took < 4, (status, took)


def test_the_launcher_is_told_the_drain_of_the_command_it_runs():
    """`--ranks N` becomes the launcher before the command parses its options: it reads
    the server's --drain itself (how long to wait before killing the ranks)."""
    @click.command()
    @click.option("--drain", type=float, default=10.0)
    def serve(drain):
        pass

    assert _option_value(serve, ["serve", "--drain", "3"], "drain") == 3.0
    assert _option_value(serve, ["serve", "--drain=2.5", "--port", "1"], "drain") == 2.5
    assert _option_value(serve, ["serve"], "drain") == 10.0
    assert _option_value(serve, ["serve", "--drain", "soon"], "drain") is None  # the command will refuse it
    assert _option_value(serve, ["serve"], "timeout") is None
    assert _without_ranks(["-m", "cli.main", "serve", "--ranks", "2", "--port", "1", "--ranks=3"]) == \
        ["-m", "cli.main", "serve", "--port", "1"]


def test_a_budget_per_rank_or_one_for_all():
    assert rank_budget(100, 1, 2) == 100 and rank_budget(None, 0, 1) is None
    assert rank_budget((100, 200), 1, 2) == 200
    with pytest.raises(UserError, match="one per rank"):
        rank_budget((100, 200), 0, 3)

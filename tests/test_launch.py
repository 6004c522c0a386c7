"""Local ranks (justfit/launch.py) and their transfers (justfit/link.py): a rank waiting
for its neighbour sleeps, the launcher relays nothing, a failing rank ends the others."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cli.common import UserError, rank_budget
from justfit.launch import launched

CHILD = str(Path(__file__).with_name("launch_child.py"))
ROOT = str(Path(__file__).resolve().parents[1])


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


def test_a_budget_per_rank_or_one_for_all():
    assert rank_budget(100, 1, 2) == 100 and rank_budget(None, 0, 1) is None
    assert rank_budget((100, 200), 1, 2) == 200
    with pytest.raises(UserError, match="one per rank"):
        rank_budget((100, 200), 0, 3)

"""One state directory shared by two live processes: each keeps its sessions whole
(byte-exact against a replay) while both write at once under the directory lock;
neither deletes the other's anonymous states or in-flight temporaries while it
lives; a dead process's leftovers are swept and its states become evictable."""

from __future__ import annotations

import subprocess

from tests.helpers.state_harness import Replay, Zygote, check, log_lines, wait_for


def test_two_live_processes_share_one_state_directory(tiny_llama_dir, tmp_path):
    state = tmp_path / "state"
    replay = Replay({"model": str(tiny_llama_dir)}, ["A", "B"], 4, tmp_path / "replay")
    root = replay.fresh_tiers(state).dir  # this model's folder in the state directory
    hold = tmp_path / "release-a"
    base = {"model": str(tiny_llama_dir), "state": str(state), "turns": 5, "steps": 4, "anon_every": 1, "memory": 0}
    zygote = Zygote()
    try:
        a = zygote.fork({**base, "sessions": ["A"], "hold": str(hold), "hold_after": 4}, tmp_path / "a.log")
        wait_for(tmp_path / "a.log", "holding")  # A lives, with anonymous states on disk
        theirs = sorted(p.name for p in (root / "anon").iterdir())
        assert len(theirs) >= 2
        live_tmp = root / "anon" / f".x.tmp-{a}-live"
        live_tmp.mkdir()
        dead = subprocess.Popen(["true"])
        dead.wait()
        dead_tmp = root / "anon" / f".x.tmp-{dead.pid}-dead"
        dead_tmp.mkdir()

        # B: a disk tier of 1 byte, so it evicts every anonymous state it may.
        b = zygote.fork({**base, "sessions": ["B"], "disk": 1}, tmp_path / "b.log")
        assert zygote.wait(b) == {"pid": b, "signal": 0, "code": 0}, log_lines(tmp_path / "b.log")
        now = {p.name for p in (root / "anon").iterdir()}
        assert set(theirs) <= now  # A's states were not evicted while A lives
        assert live_tmp.exists() and not dead_tmp.exists()  # nor its in-flight temporary

        hold.touch()
        assert zygote.wait(a)["code"] == 0, log_lines(tmp_path / "a.log")
        live_tmp.rmdir()
    finally:
        hold.touch()
        zygote.close()
    assert check(replay, state, {"A": {4}, "B": {4}}) == {"A": 4, "B": 4}
    # A is gone: its anonymous states may now be evicted by anyone.
    tiers = replay.fresh_tiers(state)
    tiers.disk_limit = 0
    tiers.fit()
    assert not [n for n in theirs if (root / "anon" / n).exists()]
    assert set(tiers.sessions) == {"A", "B"}

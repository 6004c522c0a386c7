"""What sessions may cost and what a write says: the sessions' disk quota holds in a
flood of new names and keeps the newest; evicting a recently used session is reported;
a turn that started from an older generation than the session's newest is kept as a
fork (one process, or two on one directory); a failed write says so, makes the tiers
degraded until a later one succeeds, and failure lists stay bounded; flush from
another thread publishes everything."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import pytest

from statetrans.quota import STATE_DISK_CAP, default_state_disk, split_state_disk
from statetrans.sessions import SESSIONS, SessionStore
from statetrans.tiers import StateTiers
from statetrans.writer import KEPT_FAILURES
from tests.helpers.state_engines import paged_engine, prefilled, tiers_like, words


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    return paged_engine(tiny_llama_dir, tmp_path_factory.mktemp("quota-engine"))


def _session_bytes(tiers: StateTiers) -> int:
    return sum(f.stat().st_size for f in (tiers.dir / SESSIONS).rglob("*") if f.is_file())


def _one_session_bytes(engine, tmp_path) -> int:
    probe = tiers_like(engine, tmp_path / "probe")
    e = probe.put(words(10, 0), prefilled(engine, words(10, 0)), "probe")
    assert e.write.wait(30) and e.write.ok
    return e.disk_bytes


def test_a_flood_of_names_stays_within_the_quota_and_keeps_the_newest(engine, tmp_path, request):
    names = 10_000 if request.config.getoption("--long") else 300
    size = _one_session_bytes(engine, tmp_path)
    room = 40  # sessions that fit
    tiers = tiers_like(engine, tmp_path / "state", memory=0, session_disk_limit=room * size + size // 2,
                   session_keep_s=0)
    for i in range(names):
        tokens = words(10, i)
        e = tiers.put(tokens, prefilled(engine, tokens), f"client-{i}", base=0)
        tiers.fit()  # what a server does after each request: the memory tier holds nothing here
        assert e.write.wait(30) and e.write.outcome == "stored" and e.write.evicted_recent == 0
        if i % 50 == 0 or i == names - 1:
            assert _session_bytes(tiers) <= tiers.session_disk_limit
    assert tiers.flush(30)
    assert _session_bytes(tiers) <= tiers.session_disk_limit
    kept = {r["name"] for r in tiers_like(engine, tmp_path / "state").session_list()}
    assert kept == {f"client-{i}" for i in range(names - room, names)}
    assert tiers.ledger.evicted == names - room and tiers.ledger.evicted_recent == 0


def test_evicting_a_recent_session_is_reported(engine, tmp_path):
    size = _one_session_bytes(engine, tmp_path)
    tiers = tiers_like(engine, tmp_path / "state", session_disk_limit=2 * size + size // 2, session_keep_s=3600)
    writes = []
    for name in ("a", "b", "c"):
        tokens = words(10, ord(name))
        writes.append(tiers.put(tokens, prefilled(engine, tokens), name).write)
        assert writes[-1].wait(30) and writes[-1].ok
    assert [w.evicted_recent for w in writes] == [0, 0, 1]
    tiers.take(words(10, ord("c")) + [5], "c")  # settles what the writes decided
    assert {r["name"] for r in tiers.session_list()} == {"b", "c"}
    assert not tiers.store.folder("a").exists() and tiers.store.folder("b").exists()


def test_a_stale_turn_in_one_process_becomes_a_fork(engine, tmp_path):
    tiers = tiers_like(engine, tmp_path)
    start = words(12, 1)
    tiers.put(start, prefilled(engine, start), "s")
    one, two = tiers.take(start + [7], "s"), tiers.take(start + [8], "s")  # two requests at once
    assert one.base == two.base == 1
    w1 = tiers.put(start + [7], prefilled(engine, start + [7]), "s", base=one.base).write
    w2 = tiers.put(start + [8], prefilled(engine, start + [8]), "s", base=two.base).write
    assert w1.wait(30) and (w1.outcome, w1.stored_as, w1.generation) == ("stored", "s", 2)
    assert w2.wait(30) and (w2.outcome, w2.stored_as, w2.session) == ("stored-as-fork", "s~2", "s")
    fresh = tiers_like(engine, tmp_path)
    assert fresh.session_entry("s").tokens == start + [7] and fresh.session_entry("s~2").tokens == start + [8]


def test_two_processes_on_one_session_lose_no_turn(engine, tmp_path):
    a, b = tiers_like(engine, tmp_path), tiers_like(engine, tmp_path)  # two processes' tiers on one directory
    start = words(12, 2)
    assert a.put(start, prefilled(engine, start), "s").write.wait(30)
    seen_a, seen_b = a.take(start + [7], "s"), b.take(start + [8], "s")
    assert seen_a.base == seen_b.base == 1 and seen_b.length == len(start)  # b found a's turn on disk
    wa = a.put(start + [7], prefilled(engine, start + [7]), "s", base=seen_a.base).write
    assert wa.wait(30) and wa.outcome == "stored"
    wb = b.put(start + [8], prefilled(engine, start + [8]), "s", base=seen_b.base).write
    assert wb.wait(30) and (wb.outcome, wb.stored_as) == ("stored-as-fork", "s~2")
    # Turns taken one after the other resume the newest, wherever it was written.
    later = b.take(start + [7, 9], "s")
    assert later.base == 2 and later.length == len(start) + 1
    wc = b.put(start + [7, 9], prefilled(engine, start + [7, 9]), "s", base=later.base).write
    assert wc.wait(30) and (wc.outcome, wc.generation) == ("stored", 3)
    fresh = tiers_like(engine, tmp_path)
    assert fresh.session_entry("s").tokens == start + [7, 9]
    assert fresh.session_entry("s~2").tokens == start + [8]


def test_a_failed_write_says_so_and_the_tiers_are_degraded_until_one_succeeds(engine, tmp_path, monkeypatch):
    tiers = tiers_like(engine, tmp_path)
    real = SessionStore.publish

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "secret-path"))

    monkeypatch.setattr(SessionStore, "publish", full)
    tokens = words(12, 3)
    e = tiers.put(tokens, prefilled(engine, tokens), "s")
    assert e.write.wait(30) and not e.write.ok and e.write.outcome == "not-stored"
    assert "ENOSPC" in e.write.reason and "secret-path" not in e.write.reason
    assert "ENOSPC" in tiers.degraded() and "secret-path" not in tiers.degraded()
    assert (tiers.writes, tiers.write_failures) == (1, 1)
    assert e.cache is not None and e.path is None  # the state stays in memory

    for i in range(KEPT_FAILURES + 8):
        other = words(8, 100 + i)
        tiers.put(other, prefilled(engine, other), f"o{i}")
    assert tiers.writer.wait(timeout=30)
    assert len(tiers.writer.failures) == KEPT_FAILURES and tiers.write_failures == KEPT_FAILURES + 9

    monkeypatch.setattr(SessionStore, "publish", real)
    more = tokens + [5]
    w = tiers.put(more, prefilled(engine, more), "t").write
    assert w.wait(30) and w.ok and tiers.degraded() == ""
    assert tiers.flush(30)  # the failed ones are retried
    assert tiers_like(engine, tmp_path).session_entry("s").tokens == tokens


def test_spill_failures_are_bounded_and_counted(engine, tmp_path, monkeypatch):
    tiers = tiers_like(engine, tmp_path, memory=0)

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tiers.disk, "write", full)
    for i in range(KEPT_FAILURES + 5):
        tokens = words(8, 200 + i)
        tiers.put(tokens, prefilled(engine, tokens))
        tiers.fit()
    assert len(tiers.failures) == KEPT_FAILURES and tiers.spill_failures >= KEPT_FAILURES + 5
    assert "ENOSPC" in tiers.degraded()
    assert tiers.memory_bytes > 0  # nothing lost: the states stay in memory


def test_flush_from_another_thread_publishes_everything(engine, tmp_path):
    tiers = tiers_like(engine, tmp_path)
    done = []
    for i in range(12):
        tokens = words(10, 300 + i)
        tiers.put(tokens, prefilled(engine, tokens), f"s{i}")
        if i == 6:
            t = threading.Thread(target=lambda: done.append(tiers.flush(30)))
            t.start()
    t.join(60)
    assert done == [True] and tiers.flush(30)
    assert {r["name"] for r in tiers_like(engine, tmp_path).session_list()} == {f"s{i}" for i in range(12)}


def test_default_state_disk(tmp_path):
    want = min(STATE_DISK_CAP, shutil.disk_usage(tmp_path).free // 2)
    assert abs(default_state_disk(tmp_path / "not" / "yet") - want) < 2**26  # free space moves a little meanwhile
    assert split_state_disk(8 * 2**30) == (6 * 2**30, 2 * 2**30)


def test_eviction_spares_a_session_a_live_process_is_writing(engine, tmp_path):
    """The quota never deletes a session folder holding a live writer's temporary (this
    process's here), and does once only a dead writer's is left."""
    import subprocess

    from statetrans.disk import temp_name

    tiers = tiers_like(engine, tmp_path / "state")
    tokens = words(10, 7)
    tiers.put(tokens, prefilled(engine, tokens), "s").write.wait(30)
    folder = tiers.store.folder("s")
    live = folder / temp_name("g")
    live.mkdir()
    assert not tiers.store.drop_folder(folder.name) and folder.is_dir()
    live.rmdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / f".g.tmp-{dead.pid}-0000abcd").mkdir()  # an older version's name: judged by its PID
    assert tiers.store.drop_folder(folder.name) and not folder.exists()

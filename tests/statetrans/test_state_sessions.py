"""Named sessions are user data: written through at every turn, found again by a new
engine on the same state directory with only the new message to prefill, never
deleted when their next turn starts, never rolled back to a stale turn, never lost to
a failed write; and model identity is the weights' content."""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest

import statetrans.snapshot as snapshot_mod
from justfit import SamplingParams
from statetrans.identity import DIGESTS, file_sha256
from statetrans.snapshot import SnapshotError
from tests.helpers.state_engines import paged_engine, run_tokens, words

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
_engine, _words = paged_engine, words


def _run(engine, tokens, session=None) -> list[int]:
    return run_tokens(engine, tokens, GREEDY, session)


def _generations(engine, name) -> list[int]:
    return [g for g, _ in engine.states.store.generations(name)]


def test_a_session_is_on_disk_after_every_turn_and_survives_its_next_turn_starting(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, tmp_path, state_memory=0)
    _run(engine, _words(30, 1), session="s")
    engine.flush_sessions()
    turn1 = engine.cached_tokens
    assert _generations(engine, "s") == [1]
    gen = engine.generate(turn1 + _words(10, 2), GREEDY, session="s")
    next(gen)  # turn 2 has started: its state was taken from the tiers
    assert _engine(tiny_llama_dir, tmp_path).sessions() == {"s": len(turn1)}  # still on disk
    list(gen)
    engine.flush_sessions()
    turn2 = engine.cached_tokens
    assert _generations(engine, "s") == [2]  # the older generation went once the newer was durable
    again = _engine(tiny_llama_dir, tmp_path)
    assert again.sessions() == {"s": len(turn2)}
    follow = turn2 + _words(6, 3)
    got = again.reply(follow, GREEDY, session="s")
    assert got.tokens == _run(_engine(tiny_llama_dir, tmp_path / "cold"), follow)
    assert got.stats.cached_tokens == len(turn2) and got.stats.restored_from == "disk"


def test_a_stale_turn_never_comes_back(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, tmp_path)
    tokens = []
    for turn in range(3):  # the earlier turns stay in memory as anonymous checkpoints
        _run(engine, tokens + _words(12, 10 + turn), session="s")
        tokens = engine.cached_tokens
        if turn == 0:
            engine.flush_sessions()
            shutil.copytree(engine.states.store.generations("s")[0][1], tmp_path / "turn1")
    engine.states.fit(0)  # everything spills: the checkpoints as anonymous states
    engine.flush_sessions()
    assert all(e.session is None for e in engine.states.entries.values() if e.key != engine.states.sessions["s"])
    assert _engine(tiny_llama_dir, tmp_path).sessions() == {"s": len(tokens)}
    # An older generation left behind (newer by mtime) never wins over the newest.
    (_, newest), = engine.states.store.generations("s")
    shutil.copytree(tmp_path / "turn1", newest.with_name("g000000000001"))
    assert _engine(tiny_llama_dir, tmp_path).sessions() == {"s": len(tokens)}


def test_a_damaged_newest_generation_gives_way_to_the_previous_one(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, tmp_path)
    _run(engine, _words(20, 20), session="s")
    engine.flush_sessions()
    turn1 = engine.cached_tokens
    (_, g1), = engine.states.store.generations("s")
    keep = tmp_path / "g1-copy"
    shutil.copytree(g1, keep)
    _run(engine, turn1 + _words(8, 21), session="s")
    engine.flush_sessions()
    (_, g2), = engine.states.store.generations("s")
    os.rename(keep, g1)  # as if cleanup had not happened yet
    data = bytearray((g2 / "arrays.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (g2 / "arrays.safetensors").write_bytes(bytes(data))
    again = _engine(tiny_llama_dir, tmp_path)
    follow = turn1 + _words(8, 22)
    got = again.reply(follow, GREEDY, session="s")
    assert got.tokens == _run(_engine(tiny_llama_dir, tmp_path / "cold"), follow)
    assert got.stats.cached_tokens == 0  # the damaged generation was refused ...
    assert again.states.index.session("s") is not None  # ... and the session continued


def _disk_full(path, arrays, metadata=None):
    with open(path, "wb") as f:
        f.write(b"partial")
    raise OSError(28, "No space left on device")


def test_a_failed_spill_keeps_the_state_in_memory(tiny_llama_dir, tmp_path, monkeypatch):
    engine = _engine(tiny_llama_dir, tmp_path, state_memory=0)
    with monkeypatch.context() as m:
        m.setattr(snapshot_mod.mx, "save_safetensors", _disk_full)
        _run(engine, _words(30, 30))
        e = engine.states.last
        assert e.cache is not None and e.path is None and engine.states.failures
        engine.states.fit(0)  # tried again: still failing, still kept
        assert e.cache is not None and e.path is None
    engine.states.fit(0)  # the disk has room again
    assert e.cache is None and e.path.is_dir()
    follow = e.tokens + _words(5, 31)
    s = engine.reply(follow, GREEDY).stats
    assert s.cached_tokens == len(e.tokens) and s.restored_from == "disk"
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_a_failed_write_through_loses_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    engine = _engine(tiny_llama_dir, tmp_path)
    _run(engine, _words(20, 40), session="s")
    engine.flush_sessions()
    turn1 = engine.cached_tokens
    with monkeypatch.context() as m:
        m.setattr(snapshot_mod.mx, "save_safetensors", _disk_full)
        _run(engine, turn1 + _words(8, 41), session="s")
        engine.flush_sessions()
        turn2 = engine.cached_tokens
        assert engine.states.writer.failures
        assert _engine(tiny_llama_dir, tmp_path).sessions() == {"s": len(turn1)}  # the previous turn is whole
        engine.states.fit(0)  # cannot spill what is not on disk: kept in memory
        assert engine.states.index.session("s").cache is not None
    engine.flush_sessions()  # written now
    assert _engine(tiny_llama_dir, tmp_path).sessions() == {"s": len(turn2)}


def test_within_its_quota_a_session_goes_only_when_dropped(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, tmp_path, state_disk=1, session_disk=1 << 30)
    _run(engine, _words(20, 50), session="keep")
    _run(engine, _words(20, 51), session="gone")
    engine.reset()
    engine.states.fit(0)
    engine.drop_session("gone")
    again = _engine(tiny_llama_dir, tmp_path)
    assert set(again.sessions()) == {"keep"}
    assert not engine.states.store.folder("gone").exists()


def test_session_names_never_become_paths(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, tmp_path / "state")
    name = "../../escape/\x00/é"
    _run(engine, _words(10, 60), session=name)
    engine.flush_sessions()
    assert not (tmp_path / "escape").exists()
    assert _engine(tiny_llama_dir, tmp_path / "state").sessions() == {name: len(engine.cached_tokens)}


def test_model_identity_is_the_weights_content(tmp_path):
    from tests.helpers.tiny_models import write_mlx_folder

    one = write_mlx_folder(tmp_path / "one", "llama", seed=0)
    two = write_mlx_folder(tmp_path / "two", "llama", seed=1)  # same config and sizes, other weights
    a = _engine(one, tmp_path / "state")
    _run(a, _words(20, 70))
    a.save_state(str(tmp_path / "snap"))
    with pytest.raises(SnapshotError, match="saved with model"):
        _engine(two, tmp_path / "state").load_state(str(tmp_path / "snap"))
    _engine(one, tmp_path / "state").load_state(str(tmp_path / "snap"))


def test_weight_hashes_are_remembered_by_path_size_and_mtime(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"weights" * 1000)
    real = file_sha256(f, tmp_path)
    cache = json.loads((tmp_path / DIGESTS).read_text())
    (entry,) = cache.values()
    entry["sha256"] = "f" * 64  # a remembered answer is used as is ...
    (tmp_path / DIGESTS).write_text(json.dumps(cache))
    assert file_sha256(f, tmp_path) == "f" * 64
    os.utime(f, ns=(1, 1))  # ... until the file changes
    assert file_sha256(f, tmp_path) == real


def test_chat_save_names_a_session_kept_after_every_turn(tiny_llama_dir, tmp_path):
    from cli.chat_session import ChatSession

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = _engine(tiny_llama_dir, tmp_path)
    s = ChatSession(engine, ["hello there", "/save work", "and more"], io.StringIO(), sampling=sp, show_stats=False)
    s.run()
    assert s.session == "work" and len(s.messages) == 4
    kept = engine.cached_tokens
    engine.flush_sessions()
    again = _engine(tiny_llama_dir, tmp_path)  # as after a restart: the last turn is there too
    assert again.sessions() == {"work": len(kept)}
    err = io.StringIO()
    t = ChatSession(again, ["/load work", "one more"], io.StringIO(), err, sampling=sp, show_stats=False)
    t.handle(t.read_input())
    assert t.messages == s.messages and "resumed session 'work': 4 messages" in err.getvalue()
    prompt = again.encode(t.prompt_messages() + [{"role": "user", "content": "one more"}])
    shared = next((i for i, (a, b) in enumerate(zip(kept, prompt)) if a != b), len(kept))
    t.handle(t.read_input())
    # All the template reproduces of the conversation came from the session's state.
    assert t.last_stats.restored_from == "disk" and t.last_stats.cached_tokens == shared > 40
    t.handle("/reset")
    assert t.session is None and set(_engine(tiny_llama_dir, tmp_path).sessions()) == {"work"}


def test_a_restarted_server_resumes_a_named_session(tiny_llama_dir, tmp_path):
    from tests.server.test_server import LiveServer, request

    def ask(engine, messages):
        """The reply's text, and its request's stats (the scheduler keeps the last one's)."""
        live = LiveServer(engine)
        try:
            status, _, text = request(live, "POST", "/v1/chat/completions", {
                "messages": messages, "max_tokens": 4, "temperature": 0, "session": "conv"})
            live.idle()
            stats = live.server.scheduler.last_stats
        finally:
            live.close()
        assert status == 200, text
        return json.loads(text)["choices"][0]["message"]["content"], stats

    first = [{"role": "user", "content": "the first question, long enough to matter " * 3}]
    reply, _ = ask(_engine(tiny_llama_dir, tmp_path), first)
    again = _engine(tiny_llama_dir, tmp_path)  # the server restarted on the same state directory
    held = again.states.session_entry("conv").tokens
    follow = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    prompt = again.encode(follow)
    shared = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), len(held))
    _, s = ask(again, follow)
    assert s.restored_from == "disk" and s.cached_tokens == shared >= len(again.encode(first))

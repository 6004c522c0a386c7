"""Scopes (one per client key): two scopes with the same session name and the same
tokens never reuse, read, count, list, overwrite or drop each other's states, in
memory, on disk and after a restart; the shared scope's sessions keep their folders."""

from __future__ import annotations

import hashlib

import pytest

from justfit import SamplingParams
from statetrans.sessions import folder_name
from tests.helpers.state_engines import paged_engine, prefilled, tiers_like, words

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    return paged_engine(tiny_llama_dir, tmp_path_factory.mktemp("scope-engine"))


def test_two_scopes_share_nothing(engine, tmp_path):
    tiers = tiers_like(engine, tmp_path)
    secret = words(24, 1)
    tiers.put(secret, prefilled(engine, secret), "s", scope="alice")
    tiers.put(secret[:16], prefilled(engine, secret[:16]), scope="alice")  # an anonymous prefix state too
    assert tiers.writer.wait(timeout=30)

    # Bob, with the same session name and the very same tokens, finds nothing of Alice's.
    probe = secret + words(4, 2)
    seen = tiers.take(probe, "s", scope="bob")
    assert (seen.cache, seen.length, seen.base, seen.source) == (None, 0, 0, "")
    assert tiers.take(probe, scope="bob").length == 0
    assert tiers.session_entry("s", "bob") is None and tiers.session_list("bob") == []

    # Bob's own session of that name is his: Alice's stays whole beside it.
    other = words(20, 3)
    w = tiers.put(other, prefilled(engine, other), "s", scope="bob", base=0).write
    assert w.wait(30) and w.outcome == "stored" and w.stored_as == "s"
    assert tiers.session_entry("s", "alice").tokens == secret
    assert tiers.session_entry("s", "bob").tokens == other
    assert tiers.store.folder("s", "alice") != tiers.store.folder("s", "bob")
    assert [r["name"] for r in tiers.session_list("alice")] == ["s"]
    assert tiers.session_counts() == {"alice": 1, "bob": 1}
    assert tiers.sessions == {}  # the shared scope holds none

    # Alice resumes her own: her session's state, at her generation.
    mine = tiers.take(probe, "s", scope="alice")
    assert mine.length == len(secret) and mine.session == "s" and mine.base == 1

    assert tiers.drop("s", "bob") and not tiers.drop("s", "bob")
    assert tiers.session_entry("s", "alice") is not None and tiers.store.folder("s", "alice").is_dir()


def test_a_guess_never_measures_another_scopes_prefix(engine, tmp_path):
    """The PIN probe: how many cached tokens a guess gets says nothing about another scope."""
    tiers = tiers_like(engine, tmp_path)
    pin = words(12, 4) + [101, 102, 103, 104]
    tiers.put(pin, prefilled(engine, pin), "bob", scope="bob-key")
    for digits in ([9, 9, 9, 9], [101, 9, 9, 9], [101, 102, 103, 9], [101, 102, 103, 104]):
        guess = pin[:12] + digits + [7]
        assert tiers.take(guess, scope="eve-key").length == 0
        own = tiers.take(guess, scope="bob-key")
        assert own.length == 12 + next((i for i, (a, b) in enumerate(zip(digits, pin[12:])) if a != b), 4)


def test_scopes_survive_a_restart(engine, tmp_path):
    tiers = tiers_like(engine, tmp_path, memory=0)  # every anonymous state spills to disk
    a, b = words(20, 5), words(20, 6)
    tiers.put(a, prefilled(engine, a), "s", scope="alice")
    tiers.put(b, prefilled(engine, b), "s")  # the shared scope's
    anon = words(18, 7)
    tiers.put(anon, prefilled(engine, anon), scope="alice")
    tiers.fit()
    assert tiers.flush(30)

    again = tiers_like(engine, tmp_path)
    assert again.session_entry("s", "alice").tokens == a
    assert again.session_entry("s").tokens == b and again.sessions.keys() == {"s"}
    assert again.session_counts() == {"alice": 1, "": 1}
    assert again.take(anon + [1], scope="").length == 0  # the spilled state kept its scope
    assert again.take(anon + [1], scope="alice").length == len(anon)
    # A manifest moved into another scope's folder is not that scope's session.
    moved = again.store.folder("s", "mallory")
    again.store.folder("s", "alice").rename(moved)
    third = tiers_like(engine, tmp_path)
    assert third.session_entry("s", "mallory") is None and third.session_entry("s", "alice") is None


def test_the_shared_scope_keeps_its_folders():
    assert folder_name("carol") == hashlib.sha256(b"carol").hexdigest()[:32]
    assert len({folder_name("carol"), folder_name("carol", "k1"), folder_name("carol", "k2")}) == 3
    assert folder_name("b\0c", "a") != folder_name("c", "a\0b")  # the scope's length is part of the key


def test_engine_requests_of_other_scopes_reuse_nothing(engine):
    prompt = words(40, 8)
    list(engine.generate(prompt, GREEDY, session="chat", scope="k1"))
    follow = engine.cached_tokens + words(6, 9)
    assert engine.reply(follow, GREEDY, session="chat", scope="k2").stats.cached_tokens == 0
    assert engine.reply(follow, GREEDY, session="chat", scope="k1").stats.cached_tokens > len(prompt)
    assert engine.states.session_entry("chat", "k1").tokens[:len(follow)] == follow
    assert engine.states.session_entry("chat", "k2").tokens[:len(follow)] == follow

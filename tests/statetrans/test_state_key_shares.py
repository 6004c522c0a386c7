"""Disk limits divided among scopes (a server's API keys): a flood of one scope's named
sessions or prefix-cache states evicts only that scope's own (oldest first), never
another's, and stays within its share; without a division one share holds for all,
as before (tests/statetrans/test_state_quota.py)."""

from __future__ import annotations

import time

import pytest

from statetrans.quota import share
from tests.helpers.state_engines import paged_engine, prefilled, tiers_like, words

A, B = "a1b2c3d4e5f60718", "0f1e2d3c4b5a6978"  # scopes as justfit.server.keys makes them


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    return paged_engine(tiny_llama_dir, tmp_path_factory.mktemp("shares-engine"))


def _one_session_bytes(engine, tmp_path) -> int:
    probe = tiers_like(engine, tmp_path / "probe")
    e = probe.put(words(10, 0), prefilled(engine, words(10, 0)), "probe", scope=A)
    assert e.write.wait(30) and e.write.ok
    return e.disk_bytes


def _flood(engine, tmp_path, names: int, scopes: tuple[str, ...]) -> dict:
    """Key B stores 10 sessions, then key A stores `names` new ones (each key's share
    holds 16): what is left of each, read back by a fresh process."""
    size = _one_session_bytes(engine, tmp_path)
    room = 16  # sessions that fit a share
    tiers = tiers_like(engine, tmp_path / "state", memory=0, session_disk_limit=2 * room * size + size // 2,
                       session_keep_s=0, scopes=scopes)
    b_prompts = {f"b-{i}": words(10, 10_000 + i) for i in range(10)}
    for name, tokens in b_prompts.items():
        assert tiers.put(tokens, prefilled(engine, tokens), name, scope=B, base=0).write.wait(30)
    start = time.perf_counter()
    for i in range(names):
        tokens = words(10, i)
        e = tiers.put(tokens, prefilled(engine, tokens), f"client-{i}", scope=A, base=0)
        tiers.fit()
        assert e.write.wait(30) and e.write.outcome == "stored"
    seconds = time.perf_counter() - start
    assert tiers.flush(30)
    fresh = tiers_like(engine, tmp_path / "state", scopes=scopes)
    restorable = [name for name, tokens in b_prompts.items()
                  if fresh.take(tokens + [5], name, scope=B).length == len(tokens)]
    return {"a": {r["name"] for r in fresh.session_list(A)}, "b": {r["name"] for r in fresh.session_list(B)},
            "b_restorable": restorable, "b_total": len(b_prompts), "seconds": seconds, "room": room,
            "a_bytes": tiers.ledger.scope_bytes(tiers.store, A), "a_share": share(tiers.session_disk_limit, A,
                                                                                 frozenset(scopes))}


def test_a_keys_flood_of_sessions_evicts_only_its_own(engine, tmp_path, request):
    names = 10_000 if request.config.getoption("--long") else 100  # over six times A's share
    got = _flood(engine, tmp_path, names, (A, B))
    assert got["b"] == {f"b-{i}" for i in range(10)}  # every one of B's sessions in place ...
    assert len(got["b_restorable"]) == got["b_total"]  # ... and restorable, from disk
    assert got["a"] == {f"client-{i}" for i in range(names - got["room"], names)}  # A's newest, within its share
    assert got["a_bytes"] <= got["a_share"]
    print(f"flood of {names} session names from key A: key B's sessions kept {len(got['b'])}/{got['b_total']} "
          f"(restorable {len(got['b_restorable'])}), A's {len(got['a'])} kept at {got['a_bytes']} bytes against "
          f"its share of {got['a_share']}, in {got['seconds']:.1f} s")


def test_without_a_division_the_same_flood_evicts_the_oldest_whoever_wrote_them(engine, tmp_path):
    got = _flood(engine, tmp_path, 100, ())
    assert got["b"] == set() and len(got["a"]) == 2 * got["room"]  # one share for all, as before


def test_a_keys_flood_of_prefix_cache_states_evicts_only_its_own(engine, tmp_path):
    probe = tiers_like(engine, tmp_path / "probe", memory=0)
    probe.put(words(12, 0), prefilled(engine, words(12, 0)), scope=A)
    probe.fit()
    size = probe.index.anonymous_disk_bytes
    tiers = tiers_like(engine, tmp_path / "state", memory=0, scopes=(A, B))
    tiers.disk_limit = 2 * (8 * size + size // 2)  # each key's share holds 8
    b_prompts = [words(12, 500 + i) for i in range(6)]
    for tokens in b_prompts:
        tiers.put(tokens, prefilled(engine, tokens), scope=B)
        tiers.fit()
    a_prompts = [words(12, 1000 + i) for i in range(50)]
    for tokens in a_prompts:
        tiers.put(tokens, prefilled(engine, tokens), scope=A)
        tiers.fit()
    on_disk = tiers.index.anonymous_on_disk()
    assert sum(e.disk_bytes for e in on_disk if e.scope == A) <= tiers.disk_shares(A)["anonymous"]
    assert [e.tokens for e in on_disk if e.scope == A] == a_prompts[-8:]
    assert all(tiers.take(t + [5], scope=B).length == len(t) for t in b_prompts)  # all of B's, from disk

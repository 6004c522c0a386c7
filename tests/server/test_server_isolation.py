"""Clients with different API keys share nothing stored: no prefix reuse (so
`cached_tokens` tells nothing), no session by another key's name, no listing or
deletion of another key's sessions, no eviction of them by a flood of one's own; the
status shows other keys only as counts."""

from __future__ import annotations

import json

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from justfit.server.keys import scope
from tests.helpers.server_harness import LiveServer, request

ALICE, BOB = "alice-key-0123456789", "bob-key-9876543210"


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(
        prefill_chunk=16, state_dir=str(tmp_path_factory.mktemp("isolation-state"))))
    s = LiveServer(engine, api_keys=(ALICE, BOB))
    yield s
    s.close()


def _complete(live, key: str, prompt: str, session: str | None = None) -> tuple[int, dict, dict]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **({"session": session} if session else {})}
    status, headers, text = request(live, "POST", "/v1/completions", body, headers=_auth(key))
    return status, headers, json.loads(text)


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_pin_probe_learns_nothing_across_keys(live):
    secret = "Remember this carefully: the PIN of the front door is 7315. Never tell anyone."
    status, headers, _ = _complete(live, BOB, secret, session="bob")
    assert status == 200 and headers.get("x-justfit-state", "").startswith("stored")
    # Alice's own earlier guess is in her cache: every guess below differs from it and
    # from each other at the first digit, so her own states match each equally far.
    _complete(live, ALICE, secret.replace("7315", "0000"))
    guesses = ["1111", "2222", "7315", "8888", "9999"]
    seen = [_cached(_complete(live, ALICE, secret.replace("7315", g))[2]) for g in guesses]
    assert len(set(seen)) == 1, f"cached_tokens differ by guess: {dict(zip(guesses, seen))}"
    # The same probe by the owner's own key does reuse (the test would pass vacuously otherwise).
    own = [_cached(_complete(live, BOB, secret.replace("7315", g))[2]) for g in ("1111", "7315")]
    assert own[1] > own[0]
    print(f"PIN probe across keys, cached_tokens by guess: {dict(zip(guesses, seen))}; by the owner's key: "
          f"1111 -> {own[0]}, 7315 -> {own[1]}")


def test_sessions_are_each_keys_own(live):
    _complete(live, ALICE, "alice's notes: buy milk", session="notes")
    _complete(live, BOB, "bob's notes: call mum", session="notes")  # same name, another key: no overwrite
    status, _, text = request(live, "GET", "/v1/justfit/sessions", headers=_auth(ALICE))
    names = {row["name"]: row for row in json.loads(text)["data"]}
    assert status == 200 and "notes" in names and "bob" not in names
    alice_tokens = names["notes"]["tokens"]
    _, _, text = request(live, "GET", "/v1/justfit/sessions", headers=_auth(BOB))
    assert {row["name"] for row in json.loads(text)["data"]} >= {"notes", "bob"}
    # Alice's turn on her "notes" continues her own state, not Bob's.
    reply = _complete(live, ALICE, "alice's notes: buy milk and eggs", session="notes")[2]
    assert _cached(reply) > 0
    # Status: her own sessions by name, Bob's only as counts.
    _, _, text = request(live, "GET", "/v1/justfit/status", headers=_auth(ALICE))
    sessions = json.loads(text)["sessions"]
    assert "bob" not in json.dumps(sessions["own"]) and sessions["other_sessions"] >= 2
    # Deleting: only one's own; another key's name is simply not found.
    status, _, _ = request(live, "DELETE", "/v1/justfit/sessions/bob", headers=_auth(ALICE))
    assert status == 404
    status, _, _ = request(live, "DELETE", "/v1/justfit/sessions/notes", headers=_auth(ALICE))
    assert status == 200
    _, _, text = request(live, "GET", "/v1/justfit/sessions", headers=_auth(BOB))
    assert {"notes", "bob"} <= {row["name"] for row in json.loads(text)["data"]}
    assert alice_tokens > 0


def test_session_routes_need_a_key_and_a_sane_name(live):
    status, _, _ = request(live, "GET", "/v1/justfit/sessions")
    assert status == 401
    status, _, text = request(live, "POST", "/v1/completions", raw=b'{"prompt": "x", "session": "\\ud800"}',
                              headers=_auth(ALICE))
    assert status == 400 and "session" in text


def _flooded_server(tiny_llama_dir, state_dir, session_disk: int) -> LiveServer:
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(prefill_chunk=16, state_dir=str(state_dir),
                                                             session_disk=session_disk, session_keep_s=0))
    return LiveServer(engine, api_keys=(ALICE, BOB))


def _sessions(live, key: str) -> dict[str, dict]:
    status, _, text = request(live, "GET", "/v1/justfit/sessions", headers=_auth(key))
    assert status == 200
    return {row["name"]: row for row in json.loads(text)["data"]}


def test_one_keys_flood_of_sessions_never_evicts_anothers(tiny_llama_dir, tmp_path):
    """Each key has its own share of the sessions' disk: Alice's flood of names evicts
    her own oldest sessions, and every one of Bob's stays, listed and resumable."""
    prompt = "note {:03d}: the quick brown fox jumps over the lazy dog"
    probe = _flooded_server(tiny_llama_dir, tmp_path / "probe", 1 << 30)
    try:
        assert _complete(probe, BOB, prompt.format(0), session="probe")[0] == 200
        size = _sessions(probe, BOB)["probe"]["bytes"]
    finally:
        probe.close()
    room = 4  # sessions a key's share holds; Bob's three are the oldest, the first to go without shares
    live = _flooded_server(tiny_llama_dir, tmp_path / "state", 2 * room * size + size // 2)
    try:
        for i in range(3):
            status, headers, _ = _complete(live, BOB, prompt.format(i), session=f"bob-{i}")
            assert status == 200 and headers["x-justfit-state"] == "stored"
        for i in range(5 * room):
            status, headers, _ = _complete(live, ALICE, prompt.format(100 + i), session=f"alice-{i}")
            assert status == 200 and headers["x-justfit-state"] == "stored"
        alice = _sessions(live, ALICE)
        assert set(alice) == {f"alice-{i}" for i in range(4 * room, 5 * room)}  # her newest, within her share
        assert sum(row["bytes"] for row in alice.values()) <= live.server.engine.states.disk_shares(
            scope(ALICE))["sessions"]
        assert set(_sessions(live, BOB)) == {"bob-0", "bob-1", "bob-2"}
        for i in range(3):  # each of Bob's resumes its stored state
            status, headers, reply = _complete(live, BOB, prompt.format(i) + " again", session=f"bob-{i}")
            assert status == 200 and _cached(reply) > 0 and headers["x-justfit-state"] == "stored"
    finally:
        live.close()

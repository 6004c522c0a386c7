"""A server starts and answers whatever its state directory holds: for damaged and
forged copies of a healthy directory (tests/helpers/state_forgery.py), a new engine and server
come up, a request continuing the damaged session and one with a fresh prompt are
answered 200 (from an older generation or cold), and status, sessions and metrics
answer too. 30 copies by default, 1,000 with --long."""

from __future__ import annotations

import shutil

import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from tests.helpers.server_harness import LiveServer, request
from tests.helpers.state_engines import SMALL_PAGES, run_tokens, words
from tests.helpers.state_forgery import variants

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine(model, state) -> Engine:
    return Engine(str(model), config=EngineConfig(kv=SMALL_PAGES, prefill_chunk=16, state_dir=str(state)))


@pytest.fixture(scope="module")
def healthy(tiny_llama_dir, tmp_path_factory):
    """A state directory holding session "s" (two turns) and an anonymous state."""
    state = tmp_path_factory.mktemp("served-forgery") / "state"
    engine = _engine(tiny_llama_dir, state)
    run_tokens(engine, words(24, 1), GREEDY, session="s")
    turn1 = list(engine.states.index.session("s").tokens)
    run_tokens(engine, turn1 + words(8, 2), GREEDY, session="s")
    engine.flush_sessions()
    turn2 = list(engine.states.index.session("s").tokens)
    run_tokens(engine, [250] + words(30, 3), GREEDY)
    engine.states.fit(0)
    return state, turn2


def test_the_server_starts_and_answers_over_any_state_directory(tiny_llama_dir, healthy, tmp_path, request_long):
    state, turn2 = healthy
    count = 1000 if request_long else 30
    statuses: dict[str, list[int]] = {}
    started = 0
    for variant in variants(state, tmp_path / "copy", 2 * count, seed=7, vocab=267):  # some kinds do not apply
        if started == count:
            break
        live = LiveServer(_engine(tiny_llama_dir, tmp_path / "copy"))  # the scan ran: the server is up
        started += 1
        try:
            answers = [
                request(live, "POST", "/v1/completions", {"prompt": turn2 + words(4, 9), "max_tokens": 2,
                                                          "temperature": 0, "session": "s"})[0],
                request(live, "POST", "/v1/completions", {"prompt": words(12, 5), "max_tokens": 2,
                                                          "temperature": 0})[0],
                request(live, "GET", "/v1/justfit/status")[0],
                request(live, "GET", "/v1/justfit/sessions")[0],
                request(live, "GET", "/metrics")[0],
                request(live, "GET", "/health")[0],
            ]
        finally:
            live.close()
        statuses[variant.kind] = answers
    shutil.rmtree(tmp_path / "copy", ignore_errors=True)
    failed = {kind: s for kind, s in statuses.items() if any(code != 200 for code in s)}
    assert started == count and not failed, f"answers other than 200: {failed}"
    print(f"{started} damaged state directories: the server started and answered 200 on every route each time")


@pytest.fixture
def request_long(request) -> bool:
    return bool(request.config.getoption("--long"))

"""A session write that fails (a full disk) is visible: the turn's response says it was
not stored, /health turns degraded with a reason and back once a write succeeds, and
/metrics counts it. A turn that was stored says so, streamed or not."""

from __future__ import annotations

import errno
import json

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from tests.helpers.server_harness import LiveServer, request


@pytest.fixture
def live(tiny_llama_dir, tmp_path):
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(prefill_chunk=16, state_dir=str(tmp_path / "state")))
    s = LiveServer(engine)
    yield s
    s.close()


def _turn(live, session: str, stream: bool = False) -> tuple[int, dict, str]:
    body = {"prompt": "a turn of a conversation", "max_tokens": 3, "temperature": 0, "session": session,
            "stream": stream}
    return request(live, "POST", "/v1/completions", body)


def test_a_failed_session_write_is_said_everywhere_and_clears(live, monkeypatch):
    status, headers, _ = _turn(live, "ok")
    assert status == 200 and headers["x-justfit-state"] == "stored"
    _, _, text = _turn(live, "ok-streamed", stream=True)
    assert ": x-justfit-state stored" in text and text.rstrip().endswith("data: [DONE]")

    store = live.server.engine.states.store
    publish = store.publish

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "publish", full)
    status, headers, _ = _turn(live, "lost")
    assert status == 200 and headers["x-justfit-state"].startswith("not-stored; reason=write-failed")
    _, _, text = _turn(live, "lost", stream=True)
    assert ": x-justfit-state not-stored" in text
    _, _, health = request(live, "GET", "/health")
    health = json.loads(health)
    assert health["status"] == "degraded" and "session writes" in health["reason"]
    _, _, metrics = request(live, "GET", "/metrics")
    assert 'justfit_session_writes_total{outcome="failed"} 2' in metrics and "justfit_state_writes_failing 1" in metrics

    monkeypatch.setattr(store, "publish", publish)  # the disk has room again
    status, headers, _ = _turn(live, "back")
    assert headers["x-justfit-state"] == "stored"
    assert json.loads(request(live, "GET", "/health")[2])["status"] == "ok"
    assert "justfit_state_writes_failing 0" in request(live, "GET", "/metrics")[2]


def test_anonymous_requests_carry_no_state_header(live):
    status, headers, _ = request(live, "POST", "/v1/completions", {"prompt": "no session", "max_tokens": 2})
    assert status == 200 and "x-justfit-state" not in headers

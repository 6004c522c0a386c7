"""OpenAI fields clients send: logprobs (chat and completions, through the official
client), frequency/presence penalties applied, response_format's wrong shapes refused, and prefill
progress comments on a timer."""

from __future__ import annotations

import json
import math

import pytest

from justfit import Engine
from justfit.config import EngineConfig, SamplingParams
from tests.server.test_server import LiveServer, live, request, tiny_engine  # noqa: F401 (fixtures)

PROMPT = [{"role": "user", "content": "the the the"}]


def test_chat_logprobs_through_the_openai_client(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="default", messages=PROMPT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token and math.isclose(entry.logprob, tops[0], abs_tol=1e-5)
    stream = client.chat.completions.create(model="default", messages=PROMPT, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model="default", messages=PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="default", prompt="the", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_unsupported_or_wrong_fields_are_a_clear_400(live, body, param):
    status, _, text = request(live, "POST", "/v1/chat/completions", {"messages": PROMPT, "max_tokens": 2, **body})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param, err


def test_response_format_text_is_fine(live):
    status, _, _ = request(live, "POST", "/v1/chat/completions",
                           {"messages": PROMPT, "max_tokens": 2, "response_format": {"type": "text"}})
    assert status == 200


def test_frequency_and_presence_penalties_change_repetition(tiny_engine):
    def run(**penalty) -> tuple[list[int], list[float]]:
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, **penalty)
        chunks = [c for c in tiny_engine.generate("the the the", sp) if c.token is not None]
        return [c.token for c in chunks], [c.logprob for c in chunks]

    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    plain, plain_lp = run()
    # A negative penalty rewards repeats: greedy decoding falls into a loop.
    assert repeats(run(frequency_penalty=-2.0)[0]) > repeats(plain) + 3
    assert repeats(run(presence_penalty=-2.0)[0]) > repeats(plain) + 3
    # A positive one lowers a token that already appeared: at the first repeat, unless
    # it changed the output before that, the repeated token is less likely than without.
    first = next(i for i, t in enumerate(plain) if t in plain[:i])
    for name in ("frequency_penalty", "presence_penalty"):
        tokens, lp = run(**{name: 2.0})
        if tokens[:first + 1] == plain[:first + 1]:
            assert lp[first] < plain_lp[first] - 0.05, (name, lp[first], plain_lp[first])
            assert lp[:1] == pytest.approx(plain_lp[:1])  # nothing to penalize at the first token
        else:
            assert repeats(tokens[:first + 1]) == 0


def test_prefill_progress_comments_on_a_timer(tiny_gemma3_dir):
    """A keepalive interval shorter than a prefill chunk: comments arrive while the
    chunk runs (the engine reports progress only between chunks)."""
    engine = Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=4096, context_limit=1 << 16))
    live = LiveServer(engine, keepalive_s=0.005)
    try:
        body = {"prompt": "the " * 3000, "max_tokens": 1, "stream": True}
        status, _, text = request(live, "POST", "/v1/completions", body)
        progress = [json.loads(line.split(" ", 2)[2]) for line in text.splitlines()
                    if line.startswith(": prompt_progress")]
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        # The engine's own reports: start and end of the one chunk; the rest are the timer's.
        timed = [p for p in progress if 0 < p["elapsed"] and p["processed"] == progress[0]["processed"]]
        assert len(progress) > 2 and len(timed) >= 1, progress
    finally:
        live.close()

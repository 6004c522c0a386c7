"""Speculative decoding's user-facing surface: `--draft` on the commands, a request's
`speculate` field on every API, and drafted/accepted tokens in usage, /metrics and the
status documents (the drafting itself: test_speculate.py)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from cli import common
from cli.main import main
from justfit.server.anthropic_request import anthropic_options
from justfit.server.schema import BadRequest, ollama_options, openai_options
from justfit.engine.runner import LocalRunner
from justfit.engine.stats import GenerationStats
from tests.server.test_server import live, request, tiny_engine  # noqa: F401 (fixtures)

CHAT = [{"role": "user", "content": "one two three one two three one two"}]


# -- the request's field ---------------------------------------------------------------

PARSERS = {
    "openai": lambda extra: openai_options({"messages": CHAT, **extra}, 16).sampling,
    "completions": lambda extra: openai_options({"prompt": "x", **extra}, 16, chat=False).sampling,
    "anthropic": lambda extra: anthropic_options({"messages": CHAT, "max_tokens": 4, **extra}).sampling,
    "ollama": lambda extra: ollama_options({"options": extra}, 16).sampling,  # where Ollama's clients put it
}


@pytest.mark.parametrize("api", PARSERS)
def test_speculate_field_reaches_the_sampling_params(api):
    parse = PARSERS[api]
    assert parse({}).speculate is True and parse({"speculate": None}).speculate is True
    assert parse({"speculate": False}).speculate is False
    assert parse({"speculate": True}).speculate is True
    for wrong in ("no", 0, 1, [False]):
        with pytest.raises(BadRequest) as e:
            parse({"speculate": wrong})
        assert e.value.status == 400 and e.value.param.endswith("speculate") and "boolean" in e.value.message


def test_a_non_boolean_speculate_is_a_400_naming_it(live):
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "speculate": "false"}),
                       ("/v1/messages", {"messages": CHAT, "max_tokens": 2, "speculate": 0})):
        status, _, text = request(live, "POST", path, body)
        assert status == 400 and "speculate" in text, (path, text)
    status, _, text = request(live, "POST", "/api/chat", {"messages": CHAT, "stream": False,
                                                          "options": {"speculate": "no"}})
    assert status == 400 and "options.speculate" in json.loads(text)["error"]


# -- what replies and the server report ------------------------------------------------


def test_usage_reports_drafted_and_accepted_tokens(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    drafted, accepted = r.usage.drafted_tokens, r.usage.accepted_tokens  # extra keys the client keeps
    assert isinstance(drafted, int) and 0 <= accepted <= drafted
    off = client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "speculate": False})
    assert off.usage.drafted_tokens == off.usage.accepted_tokens == 0
    assert off.choices[0].message.content == r.choices[0].message.content  # greedy: the same reply either way
    stream = client.chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    assert [c.usage for c in stream][-1].model_extra.keys() >= {"drafted_tokens", "accepted_tokens"}
    status, _, text = request(live, "POST", "/v1/messages", {"messages": CHAT, "max_tokens": 3})
    assert status == 200 and {"drafted_tokens", "accepted_tokens"} <= json.loads(text)["usage"].keys()
    status, _, text = request(live, "POST", "/api/generate", {"prompt": "one two", "stream": False,
                                                              "options": {"num_predict": 3}})
    assert status == 200 and {"drafted_tokens", "accepted_tokens"} <= json.loads(text).keys()


def _counter(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_metrics_and_status_count_drafts(live):
    request(live, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    live.idle()
    text = request(live, "GET", "/metrics")[2]
    assert "# TYPE justfit_drafted_tokens_total counter" in text
    before = _counter(text, "justfit_drafted_tokens_total"), _counter(text, "justfit_accepted_tokens_total")
    live.server.metrics.record(GenerationStats(drafted_tokens=10, accepted_tokens=7))
    text = request(live, "GET", "/metrics")[2]
    after = _counter(text, "justfit_drafted_tokens_total"), _counter(text, "justfit_accepted_tokens_total")
    assert (after[0] - before[0], after[1] - before[1]) == (10, 7)
    status = json.loads(request(live, "GET", "/v1/justfit/status")[2])
    last = status["last_request"]
    assert 0 <= last["accepted_tokens"] <= last["drafted_tokens"]
    assert last["acceptance_rate"] == (round(last["accepted_tokens"] / last["drafted_tokens"], 3)
                                       if last["drafted_tokens"] else None)
    spec = status["speculation"]
    assert spec["draft"] == "ngram" and spec["drafted_tokens"] == after[0] and spec["accepted_tokens"] == after[1]
    recent = json.loads(request(live, "GET", "/v1/justfit/live")[2])["recent"][0]  # the status page's rows
    assert (recent["drafted_tokens"], recent["accepted_tokens"], recent["acceptance_rate"]) == (10, 7, 0.7)


# -- the commands' --draft ---------------------------------------------------------------


@pytest.fixture
def loads(monkeypatch) -> list[dict]:
    """Record what each command asks load_engine for; serve gets a stand-in engine and
    does not listen, chat and generate stop there."""
    calls: list[dict] = []

    def load(*args, **kwargs):
        calls.append(kwargs)
        if "session_keep_s" in kwargs:  # serve's call
            return SimpleNamespace(runner=LocalRunner(), name="stand-in")
        raise common.UserError("loaded")

    monkeypatch.setattr(common, "load_engine", load)
    monkeypatch.setattr("justfit.server.run", lambda engine, config, ready: calls.append({"port": config.port}))
    return calls


@pytest.mark.parametrize("command", [["chat"], ["generate", "--prompt", "x"], ["serve"]])
def test_draft_option_reaches_the_engine_config(loads, command):
    for args, draft in (([], "ngram"), (["--draft", "none"], "none"), (["--draft", "ngram"], "ngram")):
        CliRunner().invoke(main, [*command, *args], input="hi\n")
        assert loads.pop(0)["draft"] == draft
        loads.clear()
    bad = CliRunner().invoke(main, [*command, "--draft", "medusa"], input="hi\n")
    assert bad.exit_code == 2 and "medusa" in bad.output and not loads


def test_load_engine_builds_the_config_with_the_draft(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def engine(model=None, budget=None, group=None, config=None):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr("justfit.Engine", engine)
    with pytest.raises(Stop):
        common.load_engine(None, None, draft="none")
    assert seen["config"].draft == "none"

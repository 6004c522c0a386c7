"""`justfit serve` against real clients: the official `openai` package, raw aiohttp
for errors and disconnects, Ollama's routes, metrics (the queue: test_server_queue.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession

from justfit import Engine
from justfit.config import EngineConfig
from justfit.server.tools import ToolCalls
from tests.helpers.server_harness import CHAT, LiveServer, request


@pytest.fixture(scope="module")
def tiny_engine(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16))


@pytest.fixture(scope="module")
def live(tiny_engine):
    s = LiveServer(tiny_engine, max_queue=4)
    yield s
    s.close()


def test_openai_client_chat_and_completions(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "the cat sat on the mat " * 3}]
    first = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0)
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.prompt_tokens > 10
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and then?"}]
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage.completion_tokens >= 1 and len(text) > 0
    assert usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2  # the first turn was reused
    done = client.completions.create(model=model, prompt="once upon a time", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="once upon a time", max_tokens=4, temperature=0, stream=True))
    assert streamed == done.choices[0].text  # same greedy reply either way


def test_prefill_progress_is_streamed(live):
    body = {**CHAT, "messages": [{"role": "user", "content": "word " * 60}], "stream": True}
    status, _, text = request(live, "POST", "/v1/chat/completions", body)
    progress = [json.loads(line.split(" ", 2)[2]) for line in text.splitlines() if line.startswith(": prompt_progress")]
    assert status == 200 and len(progress) >= 3 and text.rstrip().endswith("data: [DONE]")
    assert progress[-1]["processed"] == progress[-1]["total"] and {"cached", "elapsed"} <= progress[0].keys()


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "temperature": 9}, "temperature"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "stop": [1, 2]}, "stop"),
    ({**CHAT, "temperature": float("nan")}, "temperature"),
    ({**CHAT, "top_p": 1e400}, "top_p"),
    ({**CHAT, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
])
def test_bad_fields_are_400_naming_the_field(live, body, param):
    status, _, text = request(live, "POST", "/v1/chat/completions", body)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param and param.split(".")[-1].split("[")[0] in err["message"]


def test_malformed_unknown_and_oversized_requests(live):
    deep, huge = b"[" * 10000 + b"]" * 10000, b'{"max_tokens": ' + b"9" * 5000 + b"}"
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]", b"", deep, huge):
        status, _, text = request(live, "POST", "/v1/chat/completions", raw=raw)
        assert status == 400 and json.loads(text)["error"]["param"] == "body"
    status, _, text = request(live, "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-9"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    status, _, text = request(live, "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(text)
    status, _, _ = request(live, "GET", "/v1/chat/completions")
    assert status == 405
    status, _, text = request(live, "POST", "/v1/completions", raw=b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}')
    assert status == 413 and "error" in json.loads(text)
    status, _, text = request(live, "POST", "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 2})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt"
    status, _, _ = request(live, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 10**6})
    assert status == 200  # a top_k past the vocabulary filters nothing
    status, _, text = request(live, "POST", "/api/chat", raw=b"nope")
    assert status == 400 and isinstance(json.loads(text)["error"], str)  # Ollama's error shape
    assert request(live, "GET", "/health")[0] == 200  # still serving


def test_too_long_is_refused_before_any_work_with_the_numbers(live, tiny_engine):
    before = live.server.scheduler.completed
    body = {**CHAT, "messages": [{"role": "user", "content": "x " * 150}], "max_tokens": 400}
    status, _, text = request(live, "POST", "/v1/chat/completions", body)
    err = json.loads(text)["error"]
    assert status == 400 and err["type"] == "context_length_exceeded" == err["code"]
    assert err["details"]["max_positions"] == tiny_engine.context_limit and err["details"]["prompt_tokens"] > 250
    assert live.server.scheduler.completed == before  # nothing ran
    # without max_tokens, the reply shrinks to what fits instead
    status, _, text = request(live, "POST", "/v1/chat/completions", {**body, "max_tokens": None})
    assert status == 200


def test_budget_refusal_reports_what_fits(tiny_gemma3_dir):
    probe = Engine(str(tiny_gemma3_dir))
    budget = probe.planner.footprint(100).total
    live = LiveServer(Engine(str(tiny_gemma3_dir), budget=budget))
    try:
        body = {**CHAT, "messages": [{"role": "user", "content": "y " * 150}], "max_tokens": 4}
        status, _, text = request(live, "POST", "/v1/chat/completions", body)
        err = json.loads(text)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and "budget" in err["message"]
        fits = err["details"]["max_positions"]
        assert 100 <= fits < err["details"]["prompt_tokens"] + 4 and err["details"]["budget_bytes"] == budget
    finally:
        live.close()


def test_disconnect_cancels_within_a_step_and_leaves_state_consistent(live, tiny_engine):
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    cancelled = live.server.scheduler.cancelled

    async def go():
        async with ClientSession() as s:
            async with s.post(live.url + "/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    if b'"content": "' in line and b'"content": ""' not in line:
                        break  # got a token: hang up

    asyncio.run(go())
    live.idle()
    stats = live.server.scheduler.last_stats  # the cancelled request's
    assert live.server.scheduler.cancelled == cancelled + 1
    assert 1 <= stats.generated_tokens < 400
    entry = tiny_engine.states.last  # what was computed is stored, consistent with its tokens
    assert all(getattr(c, "offset", len(entry.tokens)) == len(entry.tokens) for c in entry.cache)
    assert request(live, "POST", "/v1/chat/completions", CHAT)[0] == 200


def test_api_key_and_cors(tiny_engine):
    live = LiveServer(tiny_engine, api_key="sekrit", cors_origin="http://localhost:3000")
    try:
        assert request(live, "GET", "/health")[0] == 200  # no key needed
        status, headers, _ = request(live, "GET", "/v1/models")
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        status, headers, _ = request(live, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        status, headers, _ = request(live, "OPTIONS", "/v1/chat/completions")
        assert status == 204 and "Authorization" in headers["Access-Control-Allow-Headers"]
    finally:
        live.close()


def test_no_cors_headers_unless_asked(live):
    _, headers, _ = request(live, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers


def test_ollama_routes(live):
    lines = request(live, "POST", "/api/chat", {"model": live.server.model_id, "messages": CHAT["messages"],
                                                 "options": {"num_predict": 4, "temperature": 0}})[2].splitlines()
    objs = [json.loads(x) for x in lines]
    assert objs[-1]["done"] and objs[-1]["eval_count"] >= 1 and not any(o["done"] for o in objs[:-1])
    streamed = "".join(o["message"]["content"] for o in objs)
    status, _, text = request(live, "POST", "/api/chat", {"messages": CHAT["messages"], "stream": False,
                                                          "options": {"num_predict": 4, "temperature": 0}})
    assert status == 200 and json.loads(text)["message"]["content"] == streamed
    status, _, text = request(live, "POST", "/api/generate", {"prompt": "hi", "stream": False, "raw": True,
                                                              "options": {"num_predict": 3, "temperature": 0}})
    body = json.loads(text)
    assert status == 200 and body["done"] and len(body["context"]) >= 2
    assert json.loads(request(live, "GET", "/api/tags")[2])["models"][0]["name"] == live.server.model_id
    assert "version" in json.loads(request(live, "GET", "/api/version")[2])
    info = json.loads(request(live, "POST", "/api/show", {"model": live.server.model_id})[2])
    assert any(k.endswith("context_length") for k in info["model_info"])
    status, _, text = request(live, "POST", "/api/chat", {"messages": CHAT["messages"], "options": {"top_k": "x"}})
    assert status == 400 and "options.top_k" in json.loads(text)["error"]


def test_metrics_and_status(live):
    request(live, "POST", "/v1/chat/completions", CHAT)
    status, headers, text = request(live, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("justfit_requests_total{", "justfit_prompt_cache_hit_ratio", "justfit_memory_bytes{kind=\"weights\"}",
                 "justfit_queue_depth", "justfit_decode_tokens_per_second"):
        assert name in text
    status = json.loads(request(live, "GET", "/v1/justfit/status")[2])
    assert status["memory"]["weights"] > 0 and status["last_request"]["phases"]
    assert {"sessions", "queue", "states", "context_limit"} <= status.keys()
    from justfit.blas import active_blas
    assert status["blas"] == active_blas()  # which BLAS, with OpenBLAS's kernels named where it runs


def test_tool_call_spans_are_held_back_and_parsed():
    class Tok:
        has_tool_calling, tool_call_start, tool_call_end = True, "<tool_call>", "</tool_call>"

        @staticmethod
        def tool_parser(text, tools):
            return json.loads(text)

    calls = ToolCalls(Tok(), [{"type": "function", "function": {"name": "get_weather"}}])
    shown = "".join(calls.feed(p) for p in ["Let me check.<to", "ol_call>{\"name\": \"get_weather\", ",
                                             "\"arguments\": {\"city\": \"Paris\"}}</tool", "_call> done"])
    shown += calls.flush()
    assert shown == "Let me check. done"
    (call,) = calls.calls()
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    plain = ToolCalls(Tok(), None)  # no tools in the request: text passes through
    assert plain.feed("<tool_call>x</tool_call>") == "<tool_call>x</tool_call>"


def test_smollm2_through_the_openai_client(smollm2_gguf):
    openai = pytest.importorskip("openai")
    live = LiveServer(Engine(str(smollm2_gguf)))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].message.content
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "And of Italy?"}]
        r2 = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
    finally:
        live.close()

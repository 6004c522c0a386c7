"""Anthropic's Messages API against a live server, through the official `anthropic`
package (streaming and not), plus the raw event sequence and error shapes."""

from __future__ import annotations

import json

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from justfit.server.anthropic_request import chat_messages, openai_tools
from justfit.server.anthropic_format import tool_blocks, tool_events
from justfit.server.schema import BadRequest
from tests.server.test_server import LiveServer, request

anthropic = pytest.importorskip("anthropic")
GREEDY = {"temperature": 0}  # anthropic 2.14 takes sampling fields only through extra_body
TURNS = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
         {"role": "user", "content": [{"type": "text", "text": "the the"}]}]


@pytest.fixture(scope="module")
def live(tiny_gemma3_dir):
    s = LiveServer(Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16)), api_key="sekret")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0)


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_messages_whole_and_streamed_agree(client):
    r = client.messages.create(model="claude-local-sonnet", max_tokens=8, system="Be brief.", messages=TURNS,
                               extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.content[0].type == "text" and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.output_tokens >= 1 and r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 10
    with client.messages.stream(model="claude-local-sonnet", max_tokens=8, system="Be brief.", messages=TURNS,
                                extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == r.content[0].text and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    # The same conversation again: its prompt comes from the stored state.
    assert final.usage.cache_read_input_tokens > 0


def test_raw_event_sequence(live):
    body = {"max_tokens": 5, "messages": TURNS, "stream": True, "temperature": 0, "top_k": 5, "top_p": 0.9}
    status, headers, text = request(live, "POST", "/v1/messages", body, headers={"x-api-key": "sekret"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    seq = events(text)
    names = [n for n, _ in seq]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"} and all(d["type"] == n for n, d in seq)
    start, delta = seq[0][1]["message"], seq[-2][1]
    assert start["usage"]["output_tokens"] == 0 and "cache_read_input_tokens" in start["usage"]
    assert delta["usage"]["output_tokens"] == 5 or delta["delta"]["stop_reason"] == "end_turn"
    text_deltas = [d["delta"]["text"] for n, d in seq if n == "content_block_delta"]
    assert all(isinstance(t, str) and t for t in text_deltas)


def test_stop_sequences(client):
    base = client.messages.create(model="default", max_tokens=12, messages=TURNS,
                                  extra_body=GREEDY).content[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip(), base
    r = client.messages.create(model="default", max_tokens=12, messages=TURNS, stop_sequences=[stop],
                               extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == base[: base.index(stop)]


def test_count_tokens(client):
    n = client.messages.count_tokens(model="claude-local-haiku", system="Be brief.", messages=TURNS).input_tokens
    r = client.messages.create(model="claude-local-haiku", max_tokens=1, system="Be brief.", messages=TURNS,
                               extra_body=GREEDY)
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens > 10


def test_errors_in_anthropic_shape(live, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=4, messages=TURNS, extra_body={"temperature": 7})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="gpt-4o", max_tokens=4, messages=TURNS)
    assert e.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="default", max_tokens=4, messages=TURNS)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}} and "x-api-key" in e.value.body["error"]["message"]
    key = {"x-api-key": "sekret"}
    for body, field in [({"messages": TURNS}, "max_tokens"),
                        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
                        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
                        ({"max_tokens": 4, "messages": TURNS, "stop_sequences": "x"}, "stop_sequences"),
                        ({"max_tokens": 4, "messages": TURNS, "tools": [{"type": "web_search_20250305"}]}, "tools")]:
        status, _, text = request(live, "POST", "/v1/messages", body, headers=key)
        err = json.loads(text)
        assert status == 400 and err["type"] == "error" and field in err["error"]["message"], err
    status, _, text = request(live, "POST", "/v1/messages", raw=b"{not json", headers=key)
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    status, _, text = request(live, "GET", "/v1/messages", headers=key)
    assert status == 405 and json.loads(text)["type"] == "error"


def test_tool_turns_reach_the_template(client):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}]
    r = client.messages.create(model="default", max_tokens=3, messages=msgs, tools=tools, extra_body=GREEDY)
    assert r.stop_reason in ("end_turn", "max_tokens")


def test_message_and_tool_conversion():
    body = {"system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                                           {"type": "tool_use", "id": "t1", "name": "f",
                                                            "input": {"a": 1}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "ok"}]},
                                                      {"type": "text", "text": "and?"}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    assert chat_messages(body) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "ok"}, {"role": "user", "content": "and?"}]
    assert openai_tools(body)[0]["function"] == {"name": "f", "description": "", "parameters": {"type": "object"}}
    assert openai_tools({**body, "tool_choice": {"type": "none"}}) is None
    call = {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert tool_blocks([call]) == [{"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"a": 1}}]
    streamed = events(b"".join(tool_events([call, call], 1)).decode())
    assert [n for n, _ in streamed] == ["content_block_start", "content_block_delta", "content_block_stop"] * 2
    assert [d["index"] for _, d in streamed] == [1, 1, 1, 2, 2, 2]
    assert streamed[0][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {}}
    assert json.loads(streamed[1][1]["delta"]["partial_json"]) == {"a": 1}
    with pytest.raises(BadRequest, match="only text tool results"):
        chat_messages({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                  "content": [{"type": "image"}]}]}]})


def test_fuzzed_bodies_never_500(live):
    """A short run of bench.serve's fuzz cases on the Anthropic routes (the bench runs 1,000)."""
    import asyncio

    from aiohttp import ClientSession, ClientTimeout

    from bench.fuzz_cases import make_cases

    cases = make_cases(80, 1, ["/v1/messages", "/v1/messages/count_tokens"])

    async def go() -> list[int]:
        async with ClientSession(timeout=ClientTimeout(total=60)) as s:
            out = []
            for c in cases:
                async with s.request(c.method, live.url + c.path, data=c.body,
                                     headers={"Content-Type": c.content_type, "x-api-key": "sekret"}) as r:
                    body = await r.text()
                    out.append(r.status)
                    if r.status >= 400 and r.url.path.startswith("/v1/messages"):
                        assert json.loads(body)["type"] == "error", body  # Anthropic's shape throughout
            return out

    statuses = asyncio.run(go())
    assert all(s < 500 for s in statuses) and statuses.count(400) > 20

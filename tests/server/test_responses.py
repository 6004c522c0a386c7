"""OpenAI's Responses API (/v1/responses) through the official `openai` client against
the embedded SmolLM2: whole and streamed replies, input items, instructions,
previous_response_id continuing the stored state, storage per key (GET, DELETE,
input_items, eviction, store false), max_output_tokens, errors in OpenAI's shape, and
the store and the stream events on their own."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from justfit import Engine
from justfit.server.responses_store import StoreLimits
from tests.helpers.server_harness import LiveServer, request

openai = pytest.importorskip("openai")

KEYS = ("key-main", "key-other", "key-evict", "key-chain", "key-fuzz")
EVICT_COUNT = 3


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    s = LiveServer(Engine(str(smollm2_gguf)), api_keys=KEYS, responses=StoreLimits(max_count=EVICT_COUNT + 3))
    yield s
    s.close()


def client(live, key: str = "key-main"):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)


def sse(text: str) -> list[dict]:
    """The data of each named event of an SSE body."""
    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if block.startswith("event: ")]


def test_whole_and_streamed_agree(live):
    c = client(live)
    ask = {"model": "default", "input": "What is the capital of France?", "max_output_tokens": 12,
           "temperature": 0, "store": False}
    whole = c.responses.create(**ask)
    assert whole.object == "response" and whole.status == "completed" and "Paris" in whole.output_text
    assert whole.output[0].type == "message" and whole.output[0].role == "assistant"
    u = whole.usage
    assert u.input_tokens > 10 and u.output_tokens >= 1 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    events = list(c.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == whole.output_text  # the same greedy reply
    with c.responses.stream(**ask) as stream:  # the client's accumulator checks every event against the last
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text == whole.output_text and final.usage.output_tokens == u.output_tokens


def _client_events(raw: list[bytes], tools: list) -> list[str]:
    """The events of a stream as the official client's accumulator hands them out (it
    checks each against the ones before it)."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    state = ResponseStreamState(input_tools=tools, text_format=openai.omit)
    return [e.type for data in sse(b"".join(raw).decode())
            for e in state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))]


def test_input_items_and_instructions(live):
    c = client(live)
    base = {"model": "default", "max_output_tokens": 2, "temperature": 0, "store": False}
    items = [{"role": "user", "content": "What is 2+2?"},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "simple sum"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "4"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "So?"}]}]
    plain = c.responses.create(**base, input=items)
    without_reasoning = c.responses.create(**base, input=[i for i in items if i.get("type") != "reasoning"])
    assert plain.usage.input_tokens == without_reasoning.usage.input_tokens  # reasoning items are ignored
    rule = "You answer in French, briefly and politely, and you never use more than ten words in a reply."
    told = c.responses.create(**base, input=items, instructions=rule)
    as_system = c.responses.create(**base, input=[{"role": "system", "content": rule}, *items])
    assert told.usage.input_tokens == as_system.usage.input_tokens != plain.usage.input_tokens  # the system turn
    assert told.instructions == rule
    one = c.responses.create(**base, input="Hello")
    as_item = c.responses.create(**base, input=[{"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello"}]}])
    assert one.usage.input_tokens == as_item.usage.input_tokens


def test_items_become_chat_messages():
    from justfit.server.responses_request import chat_messages, input_items

    items = input_items({"input": [
        {"role": "developer", "content": "be terse"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "reasoning", "summary": []}]})
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call",
                                          "function_call_output"] and all(i["id"] for i in items)
    msgs = chat_messages(items, "instructions first")
    assert msgs[0] == {"role": "system", "content": "instructions first"}
    assert msgs[1] == {"role": "system", "content": "be terse"}
    assert msgs[2]["role"] == "assistant" and msgs[2]["content"] == "calling"
    assert [(t["id"], t["function"]["name"], t["function"]["arguments"]) for t in msgs[2]["tool_calls"]] == [
        ("c1", "f", {"x": 1}), ("c2", "g", {})]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "one", "name": "f"}


def test_previous_response_id_reuses_the_stored_state(live):
    c = client(live, "key-chain")
    ask = {"model": "default", "max_output_tokens": 16, "temperature": 0}
    story = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig", "kiwi", "lime"] * 12)
    first = c.responses.create(**ask, input=story + "\nName the first fruit.", instructions="Be brief.")
    turns = [first]
    for question in ("Name the second fruit.", "Name the third fruit."):
        prev = turns[-1]
        nxt = c.responses.create(**ask, input=question, previous_response_id=prev.id, instructions="Be brief.")
        context = prev.usage.input_tokens + prev.usage.output_tokens
        assert nxt.usage.input_tokens > context  # the conversation so far came with it
        assert nxt.usage.input_tokens_details.cached_tokens >= 0.95 * context, (nxt.usage, prev.usage)
        assert nxt.usage.input_tokens_details.cached_tokens >= context - 1  # all but the last token's state
        assert nxt.previous_response_id == prev.id
        turns.append(nxt)
    sessions = json.loads(request(live, "GET", "/v1/justfit/sessions",
                                  headers={"Authorization": "Bearer key-chain"})[2])["data"]
    assert len(sessions) == 1 and sessions[0]["name"].startswith("responses:")  # one session for the chain
    # Two responses continuing the same parent: both see exactly its conversation.
    again = {**ask, "input": "Name the third fruit.", "previous_response_id": turns[1].id, "instructions": "Be brief."}
    fork_a, fork_b = c.responses.create(**again), c.responses.create(**again)
    assert fork_a.usage.input_tokens == fork_b.usage.input_tokens == turns[2].usage.input_tokens
    parent = turns[1].usage.input_tokens + turns[1].usage.output_tokens
    assert fork_b.usage.input_tokens_details.cached_tokens >= 0.95 * parent
    items = [i.model_dump() for i in c.responses.input_items.list(fork_b.id, order="asc", limit=100)]
    assert [i["type"] for i in items] == ["message"] * 5 and "first fruit" in items[0]["content"][0]["text"]


def test_a_turn_extends_the_previous_turns_tokens_as_generated(live):
    from justfit.server.responses_routes import prompt_tokens, reply_context

    engine = live.server.engine
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Say hello."}]
    first: dict = {}
    prompt = prompt_tokens(engine, msgs, None, None, first)
    assert prompt == engine.apply_chat_template(msgs)  # no context: as a chat completion
    reply = "Hello there, friend"
    generated = [i for ch in reply for i in tok.encode(ch, add_special_tokens=False)]  # not how it tokenizes whole
    assert generated != tok.encode(reply, add_special_tokens=False)
    eos = set(tok.eos_token_ids)
    response = {"output": [{"type": "message", "content": [{"type": "output_text", "text": reply}]}]}
    context = reply_context(response, first["text"], prompt, [*generated, *sorted(eos)[:1]], eos)
    assert context["ids"] == [*prompt, *generated]  # the end-of-turn token left to the template
    nxt = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
    ids = prompt_tokens(engine, nxt, None, context, {})
    assert ids[:len(context["ids"])] == context["ids"] and tok.decode(ids) == tok.decode(engine.apply_chat_template(nxt))
    other = [{"role": "system", "content": "New instructions."}, *nxt[1:]]  # no longer an extension: afresh
    assert prompt_tokens(engine, other, None, context, {}) == engine.apply_chat_template(other)
    called = {"output": [{"type": "function_call"}]}
    assert reply_context(called, first["text"], prompt, generated, eos) is None


def _error(status_error) -> dict:
    return status_error.response.json()["error"]


def test_store_false_then_previous_response_id_is_404(live):
    c = client(live)
    r = c.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="default", input="again", previous_response_id=r.id, max_output_tokens=2)
    assert _error(e.value) == {"message": f"Response with id '{r.id}' not found.", "type": "invalid_request_error",
                               "param": "previous_response_id", "code": "previous_response_not_found"}
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_get_delete_and_input_items(live):
    c = client(live)
    r = c.responses.create(model="default", input=[{"role": "user", "content": "one"},
                                                   {"role": "assistant", "content": "two"},
                                                   {"role": "user", "content": "three"}],
                           max_output_tokens=3, temperature=0)
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.input_tokens == r.usage.input_tokens
    texts = [i.content[0].text for i in c.responses.input_items.list(r.id)]
    assert texts == ["three", "two", "one"]  # newest first, as OpenAI lists them
    page = c.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["one", "two"] and page.has_more
    rest = c.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["three"] and not rest.has_more
    deleted = c.responses.delete(r.id)  # the client returns None; the body says what went
    assert deleted is None
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id),
                 lambda: c.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert _error(e.value)["code"] == "response_not_found"


def test_another_key_cannot_read_it(live):
    mine = client(live).responses.create(model="default", input="secret plan", max_output_tokens=2)
    other = client(live, "key-other")
    for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.input_items.list(mine.id),
                 lambda: other.responses.delete(mine.id),
                 lambda: other.responses.create(model="default", input="x", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client(live).responses.retrieve(mine.id).id == mine.id  # still there for its own key


def test_eviction_by_count_answers_404(live):
    c = client(live, "key-evict")
    made = [c.responses.create(model="default", input=f"number {i}", max_output_tokens=1) for i in range(EVICT_COUNT + 4)]
    assert c.responses.retrieve(made[-1].id).id == made[-1].id
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="default", input="x", previous_response_id=made[0].id, max_output_tokens=1)
    assert _error(e.value)["param"] == "previous_response_id" and e.value.status_code == 404


def test_max_output_tokens_makes_it_incomplete(live):
    c = client(live)
    ask = {"model": "default", "input": "Count from one to one hundred in words.", "max_output_tokens": 3,
           "temperature": 0, "store": False}
    r = c.responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    events = list(c.responses.create(**ask, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == \
        "max_output_tokens"
    with c.responses.stream(**ask) as stream:  # the client's accumulator takes an incomplete end too
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete" and "response.output_item.done" in kinds


BAD = [({"input": 5}, "input"), ({}, "input"), ({"input": [{"role": "boss", "content": "x"}]}, "input[0].role"),
       ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
       ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
       ({"input": [{"type": "input_image"}]}, "input[0].type"),
       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]"),
       ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"), ({"input": "x", "temperature": 9}, "temperature"),
       ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
       ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format.schema"),
       ({"input": "x", "tool_choice": "required"}, "tool_choice"), ({"input": "x", "background": True}, "background"),
       ({"input": "x", "store": "yes"}, "store"), ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
       ({"input": []}, "input"), ({"input": "x", "previous_response_id": 7}, "previous_response_id")]


@pytest.mark.parametrize("body,param", BAD)
def test_malformed_bodies_in_the_error_shape(live, body, param):
    status, _, text = request(live, "POST", "/v1/responses", body, headers={"Authorization": "Bearer key-main"})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", text
    assert isinstance(err["message"], str) and "code" in err


def test_fuzzed_bodies_never_500(live):
    """bench.serve's fuzz cases on /v1/responses, and random mutations of a valid body."""
    from aiohttp import ClientSession, ClientTimeout

    from bench.fuzz_cases import dumps, make_cases

    rng = random.Random(7)
    cases = [(c.method, c.path, c.body, c.content_type) for c in make_cases(60, 3, ["/v1/responses"])]
    for _ in range(30):  # random shapes where items go
        junk = rng.choice([None, 1, "x", [], {}, [{}], [{"type": rng.choice(["message", "function_call", "x"])}],
                           [{"role": "user", "content": [{"type": "input_text"}]}], [[1]], {"a": [1]}])
        body = {"input": junk if rng.random() < 0.7 else "hi", "max_output_tokens": 1, "store": rng.random() < 0.5,
                rng.choice(["tools", "text", "tool_choice", "instructions", "metadata"]): junk}
        cases.append(("POST", "/v1/responses", dumps(body), "application/json"))
    for path in ("/v1/responses/%2e%2e", "/v1/responses/" + "x" * 3000, "/v1/responses/r/input_items?limit=x",
                 "/v1/responses/r/input_items?order=up"):
        cases.append(("GET", path, b"", "application/json"))

    async def go() -> list[int]:
        async with ClientSession(timeout=ClientTimeout(total=60)) as s:
            out = []
            for method, path, body, kind in cases:
                async with s.request(method, live.url + path, data=body,
                                     headers={"Content-Type": kind, "Authorization": "Bearer key-fuzz"}) as r:
                    text = await r.text()
                    out.append(r.status)
                    if r.status >= 400:
                        assert set(json.loads(text)["error"]) >= {"message", "type", "param", "code"}, text
            return out

    statuses = asyncio.run(go())
    assert all(s < 500 for s in statuses) and statuses.count(400) > 30 and 200 in statuses


def test_text_format_and_tool_choice_become_constraints():
    from justfit.server.responses_request import responses_request

    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}, "strict": True}
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    req = responses_request({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                                "strict": True}}}, 8)
    assert req.opts.sampling.constraint.kind == "json_schema" and json.loads(req.opts.sampling.constraint.text) == schema
    assert req.opts.constraint_field == "text.format" and req.echo["text"]["format"]["name"] == "a"
    assert responses_request({"input": "x", "text": {"format": {"type": "json_object"}}}, 8).opts.sampling.constraint.kind \
        == "json_object"
    auto = responses_request({"input": "x", "tools": [tool, {"type": "web_search"}]}, 8).opts
    assert auto.tool_mode.choice == "auto" and [t["function"]["name"] for t in auto.tools] == ["get_weather"]
    assert auto.sampling.constraint is None
    named = responses_request({"input": "x", "tools": [tool], "tool_choice": {"type": "function",
                                                                              "name": "get_weather"}}, 8).opts
    forced = json.loads(named.sampling.constraint.text)
    assert named.tool_mode.choice == "forced" and forced["items"]["properties"]["name"] == {"const": "get_weather"}
    one = responses_request({"input": "x", "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False},
                            8).opts
    assert json.loads(one.sampling.constraint.text)["properties"]["arguments"]["required"] == ["city"]
    assert responses_request({"input": "x", "tools": [tool], "tool_choice": "none"}, 8).opts.tools is None


def test_forced_tool_call_end_to_end(live):
    if getattr(live.server.engine, "grammars", None) is None:
        pytest.skip("this engine does not constrain replies yet (justfit.engine.grammar)")
    c = client(live)
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                           "required": ["city"], "additionalProperties": False}}
    ask = {"model": "default", "input": "What is the weather in Paris?", "tools": [tool], "store": False,
           "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "temperature": 0,
           "parallel_tool_calls": False}
    r = c.responses.create(**ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r
    assert set(json.loads(calls[0].arguments)) == {"city"}
    with c.responses.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and final.output[-1].arguments == calls[0].arguments
    shaped = c.responses.create(model="default", input="Give a number.", store=False, max_output_tokens=30,
                                temperature=0, text={"format": {"type": "json_schema", "name": "n", "schema": {
                                    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}})
    assert shaped.status == "completed" and isinstance(json.loads(shaped.output_text)["n"], int), shaped


# -- the stream's function calls and the store, without a model ------------------------------------
def test_function_call_events_parse_in_the_client():
    from justfit.engine.stats import GenerationStats
    from justfit.server.pump import Ending
    from justfit.server.responses_format import ResponsesFormat
    from justfit.server.tools import JsonCalls

    tools = [{"type": "function", "name": "get_weather", "parameters": {}, "strict": False}]
    stats = GenerationStats(prompt_tokens=10, generated_tokens=5, finish_reason="stop")
    kept = []
    fmt = ResponsesFormat({"model": "m"}, 10, lambda response, stored, ids: kept.append(response))
    calls = [{"id": "call_1", "type": "function", "index": 0,
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    raw = fmt.opening(0) + fmt.token("Checking.", None) + fmt.ending(Ending(stats, None, "", calls, []))
    seen = _client_events(raw, tools)
    assert seen[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [o["type"] for o in kept[0]["output"]] == ["message", "function_call"]
    call = kept[0]["output"][1]
    assert call["call_id"] == "call_1" and call["name"] == "get_weather" and json.loads(call["arguments"]) == {
        "city": "Oslo"} and call["id"].startswith("fc_")
    # A forced call (a constrained reply) streams as it is generated: two calls, arguments in pieces.
    fmt, reader = ResponsesFormat({"model": "m"}, 10, lambda response, stored, ids: kept.append(response)), JsonCalls()
    raw = fmt.opening(0)
    for piece in ['[{"name": "get_weather", "argu', 'ments": {"city": "Os', 'lo"}}, {"name": "get_weather",',
                  ' "arguments": {"city": "Rome"}}]']:
        raw += fmt.token(reader.feed(piece), None) + fmt.call_pieces(reader.pieces())
    raw += fmt.ending(Ending(stats, None, reader.flush(), reader.calls(streaming=True), []))
    seen = _client_events(raw, tools)
    assert seen.count("response.function_call_arguments.delta") >= 3 and seen[-1] == "response.completed"
    assert "response.output_text.delta" not in seen
    assert [json.loads(o["arguments"]) for o in kept[1]["output"]] == [{"city": "Oslo"}, {"city": "Rome"}]


def _record(rid: str, text: str = "x", session: str | None = "s", at: float = 1000.0):
    from justfit.server.responses_store import StoredResponse

    return StoredResponse(rid, at, session, {"id": rid, "output": []}, [{"type": "message", "text": text}])


def test_store_is_durable_bounded_and_quarantines(tmp_path):
    from justfit.server.responses_store import QUARANTINE, ResponseStore

    now = [1000.0]
    store = ResponseStore(tmp_path, StoreLimits(max_count=3, max_bytes=10_000, max_age_s=60), clock=lambda: now[0])
    for i in range(3):
        assert store.put("scope-a", _record(f"resp_{i}", session=f"s{i % 2}", at=now[0] + i)) == []
    now[0] += 10
    store.run(lambda: None).result()
    names = [p.name for p in (tmp_path).rglob("*.json")]
    assert len(names) == 3 and not any("resp_" in n or "scope-a" in n for n in names)  # hashed names only
    reopened = ResponseStore(tmp_path, store.limits, clock=lambda: now[0])
    assert reopened.get("scope-a", "resp_1").items[0]["text"] == "x"
    with_context = _record("resp_ctx", at=now[0] - 5)
    with_context.context = {"text": "<prompt>hi", "ids": [1, 2, 3]}
    store.put("scope-z", with_context)
    bad = _record("resp_bad", at=now[0] - 5)
    bad.context = {"text": "t", "ids": [True, -1]}
    store.put("scope-z", bad)
    store.run(lambda: None).result()
    fresh_z = ResponseStore(tmp_path, store.limits, clock=lambda: now[0])
    assert fresh_z.get("scope-z", "resp_ctx").context == {"text": "<prompt>hi", "ids": [1, 2, 3]}
    assert fresh_z.get("scope-z", "resp_bad").context is None  # not token ids: the next turn tokenizes afresh
    assert reopened.get("scope-b", "resp_1") is None  # another scope never sees it
    gone = reopened.put("scope-a", _record("resp_3", session="s9", at=now[0]))  # past the count: resp_0 goes
    assert reopened.get("scope-a", "resp_0") is None and gone == []  # s0 is still named by resp_2
    assert reopened.put("scope-a", _record("resp_4", session="s9", at=now[0])) == ["s1"]  # resp_1 went: nothing names s1
    assert reopened.is_head("scope-a", reopened.get("scope-a", "resp_4"))
    assert not reopened.is_head("scope-a", reopened.get("scope-a", "resp_3"))
    big = _record("resp_big", "y" * 20_000, "sb", now[0])
    reopened.put("scope-a", big)  # over the bytes limit alone: it stays, every older one goes
    assert reopened.ids("scope-a") == ["resp_big"]
    now[0] += 61  # past the age limit
    assert reopened.get("scope-a", "resp_big") is None
    reopened.run(lambda: None).result()
    # A damaged file is quarantined, never a crash.
    fresh = ResponseStore(tmp_path, StoreLimits(), clock=lambda: now[0])
    fresh.put("scope-c", _record("resp_ok", at=now[0]))
    fresh.run(lambda: None).result()
    path = next(p for p in tmp_path.rglob("*.json") if QUARANTINE not in p.parts)
    path.write_bytes(path.read_bytes().split(b"\n")[0] + b"\n{not json")
    again = ResponseStore(tmp_path, StoreLimits(), clock=lambda: now[0])
    assert again.get("scope-c", "resp_ok") is None and not path.exists()
    assert len(os.listdir(tmp_path / QUARANTINE)) == 1
    path.write_bytes(b"\x00garbage")  # a header that does not parse: quarantined at the scan
    assert ResponseStore(tmp_path, StoreLimits(), clock=lambda: now[0]).get("scope-c", "resp_ok") is None
    assert not path.exists() and len(os.listdir(tmp_path / QUARANTINE)) == 2

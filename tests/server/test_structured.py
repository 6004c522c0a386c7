"""Structured output and tool_choice on the OpenAI, Ollama and Anthropic APIs: each
API's fields mapped to one OutputConstraint and ToolMode (justfit.server.structured),
a forced tool call read as it streams (justfit.server.tools.JsonCalls) and written in
each API's shape, then the real SmolLM2 through the official clients."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from justfit.config import OutputConstraint, SamplingParams
from justfit.server.anthropic_format import AnthropicFormat
from justfit.server.openai_format import OpenAIFormat
from justfit.server.pump import Ending, Whole
from justfit.server.schema import BadRequest, Options
from justfit.server.structured import (anthropic_structure, choice_regex, extension_constraints,
                                       ollama_structure, openai_structure, response_format_constraint,
                                       tool_choice_constraint)
from justfit.server.tools import CallArguments, CallStart, JsonCalls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {  # no other keys: a reply ends
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
    "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def opts(tools=None) -> Options:
    return Options(SamplingParams(), False, tools=tools)


def bad(fn, *args) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


# -- the mapping ---------------------------------------------------------------------------
def test_response_format_maps_to_a_constraint():
    assert response_format_constraint(None) is None
    assert response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}) == OutputConstraint("json_object")
    c = response_format_constraint({"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                           "schema": PERSON}})
    assert c.kind == "json_schema" and json.loads(c.text) == PERSON
    assert list(json.loads(c.text)["properties"]) == ["name", "age"]  # order kept: the reply's key order


@pytest.mark.parametrize("fmt, param", [
    ("json", "response_format"),
    ({}, "response_format.type"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}}, "response_format.json_schema.strict"),
])
def test_response_format_wrong_shapes_name_the_field(fmt, param):
    assert bad(response_format_constraint, fmt).param == param


def test_tool_choice_none_auto_and_default():
    assert tool_choice_constraint([WEATHER], "none", None) == (None, tool_choice_constraint(None, None, None)[1])
    constraint, mode = tool_choice_constraint([WEATHER], "none", None)
    assert mode.choice == "none" and mode.tools is None
    for choice in (None, "auto"):
        constraint, mode = tool_choice_constraint([WEATHER], choice, None)
        assert constraint is None and mode.choice == "auto" and mode.tools[0]["function"]["name"] == "get_weather"
    assert tool_choice_constraint(None, "auto", None)[1].choice == "none"  # no tools: nothing to call


def test_tool_choice_required_is_an_array_of_calls_of_any_tool():
    constraint, mode = tool_choice_constraint([WEATHER, TIME], "required", None)
    schema = json.loads(constraint.text)
    assert mode.choice == "forced" and mode.parallel and len(mode.tools) == 2
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == TIME["function"]["parameters"]
    one = json.loads(tool_choice_constraint([WEATHER, TIME], "required", False)[0].text)
    assert "anyOf" in one and one.get("type") != "array"  # parallel_tool_calls false: one call


def test_tool_choice_named_function():
    constraint, mode = tool_choice_constraint([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                                              False)
    assert mode.choice == "forced"
    assert json.loads(constraint.text) == {
        "type": "object", "properties": {"name": {"const": "get_time"}, "arguments": TIME["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}
    e = bad(tool_choice_constraint, [WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    assert e.param == "tool_choice.function.name" and "'nope'" in e.message and "get_weather" in e.message


def test_tool_choice_allowed_tools():
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    constraint, mode = tool_choice_constraint([WEATHER, TIME], choice, False)
    assert [t["function"]["name"] for t in mode.tools] == ["get_time"]
    assert json.loads(constraint.text)["properties"]["name"] == {"const": "get_time"}
    choice["allowed_tools"]["mode"] = "auto"
    assert tool_choice_constraint([WEATHER, TIME], choice, None)[0] is None


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "custom"}, "tool_choice.type"),
    ([{"type": "custom", "name": "x"}], "auto", "tools[0].type"),
    ([{"type": "function", "function": {}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "tools[0].function.parameters"),
])
def test_tool_choice_wrong_shapes(tools, choice, param):
    assert bad(tool_choice_constraint, tools, choice, None).param == param


def test_a_tools_own_defs_are_hoisted_to_the_root():
    """A pydantic model's parameters refer to their `$defs` from the root: nested in the
    call's schema they move under the root's `$defs`, every `$ref` following."""
    params = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"},
                                               "tags": {"type": "array", "items": {"$ref": "#"}}},
              "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    tool = {"type": "function", "function": {"name": "save", "parameters": params}}
    schema = json.loads(tool_choice_constraint([tool], "required", False)[0].text)
    assert schema["properties"]["arguments"] == {"$ref": "#/$defs/tool0"}
    assert schema["$defs"]["tool0__Address"] == params["$defs"]["Address"]
    moved = schema["$defs"]["tool0"]
    assert moved["properties"]["home"] == {"$ref": "#/$defs/tool0__Address"}
    assert moved["properties"]["tags"]["items"] == {"$ref": "#/$defs/tool0"} and "$defs" not in moved
    assert "$defs" in params  # the request's own schema is never changed


def test_extensions_and_choice():
    found = dict(extension_constraints({"grammar": 'root ::= "yes" | "no"'}))
    assert found == {"grammar": OutputConstraint("gbnf", 'root ::= "yes" | "no"')}
    assert dict(extension_constraints({"regex": "[0-9]+"})) == {"regex": OutputConstraint("regex", "[0-9]+")}
    assert dict(extension_constraints({"json_schema": PERSON}))["json_schema"].kind == "json_schema"
    so = dict(extension_constraints({"structured_outputs": {"choice": ["a.b", "c|d (e)"]}}))
    pattern = so["structured_outputs.choice"].text
    assert pattern == r"(a\.b|c\|d \(e\))"
    assert re.fullmatch(pattern, "c|d (e)") and not re.fullmatch(pattern, "axb")
    assert dict(extension_constraints({"guided_json": json.dumps(PERSON)}))["guided_json"].kind == "json_schema"
    assert bad(choice_regex, [], "choice").param == "choice"
    assert bad(extension_constraints, {"structured_outputs": {"regex": 5}}).param == "structured_outputs.regex"


def test_at_most_one_constraint_a_request():
    body = {"response_format": {"type": "json_object"}, "regex": "a+"}
    e = bad(openai_structure, body, opts())
    assert e.code == "conflicting_constraints" and "'response_format'" in e.message and "'regex'" in e.message
    body = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert bad(openai_structure, body, opts()).param == "tool_choice"


def test_openai_structure_sets_the_sampling_constraint_and_tool_mode():
    out = openai_structure({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, opts())
    assert out.sampling.constraint == OutputConstraint("json_object") and out.constraint_field == "response_format"
    assert out.tool_mode.choice == "auto" and out.tools == out.tool_mode.tools
    forced = openai_structure({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, opts())
    assert forced.constraint_field == "tool_choice" and not forced.tool_mode.parallel
    none = openai_structure({"tools": [WEATHER], "tool_choice": "none"}, opts())
    assert none.tools is None and none.sampling.constraint is None
    plain = openai_structure({"tools": [WEATHER], "tool_choice": "required"}, opts(), chat=False)
    assert plain.tool_mode.choice == "none" and plain.sampling.constraint is None  # completions: no tools
    assert bad(openai_structure, {"parallel_tool_calls": "yes"}, opts()).param == "parallel_tool_calls"


def test_ollama_format():
    assert ollama_structure({"format": "json"}, opts()).sampling.constraint == OutputConstraint("json_object")
    out = ollama_structure({"format": PERSON}, opts())
    assert out.sampling.constraint.kind == "json_schema" and out.constraint_field == "format"
    assert ollama_structure({"format": ""}, opts()).sampling.constraint is None
    assert ollama_structure({}, opts([WEATHER])).tool_mode.choice == "auto"
    assert bad(ollama_structure, {"format": "yaml"}, opts()).param == "format"


def test_anthropic_output_config_and_tool_choice():
    fmt = {"type": "json_schema", "schema": PERSON}
    for body, field in (({"output_config": {"format": fmt}}, "output_config.format"),
                        ({"output_format": fmt}, "output_format")):
        out = anthropic_structure(body, opts())
        assert out.constraint_field == field and json.loads(out.sampling.constraint.text) == PERSON
    assert bad(anthropic_structure, {"output_config": {"format": {"type": "xml"}}}, opts()).param == \
        "output_config.format.type"
    tools = [WEATHER, TIME]  # anthropic_request.openai_tools's form
    tool = anthropic_structure({"tool_choice": {"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True}}, opts(tools))
    assert tool.tool_mode.choice == "forced" and not tool.tool_mode.parallel
    assert json.loads(tool.sampling.constraint.text)["properties"]["name"] == {"const": "get_weather"}
    any_ = anthropic_structure({"tool_choice": {"type": "any"}}, opts(tools))
    assert json.loads(any_.sampling.constraint.text)["type"] == "array"
    assert anthropic_structure({"tool_choice": {"type": "auto"}}, opts(tools)).tool_mode.choice == "auto"
    assert anthropic_structure({}, opts(tools)).tool_mode.choice == "auto"
    assert bad(anthropic_structure, {"tool_choice": {"type": "tool", "name": "x"}}, opts(tools)).param == \
        "tool_choice.function.name"
    assert bad(anthropic_structure, {"tool_choice": {"type": "maybe"}}, opts(tools)).param == "tool_choice.type"


# -- a forced call, read as it streams -------------------------------------------------------
def feed_in_pieces(text: str, size: int) -> tuple[JsonCalls, list]:
    calls, pieces = JsonCalls(), []
    for i in range(0, len(text), size):
        assert calls.feed(text[i:i + size]) == ""
        pieces += calls.pieces()
    return calls, pieces


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_json_calls_stream_each_call_and_its_arguments(size):
    text = ('[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"a": "]"}]}}, '
            '{"arguments": {"zone": "UTC"}, "name": "get_time"}]')
    calls, pieces = feed_in_pieces(text, size)
    whole = calls.calls()
    assert [c["function"]["name"] for c in whole] == ["get_weather", "get_time"]
    assert json.loads(whole[0]["function"]["arguments"]) == {"city": 'Pa"ris}', "n": [1, {"a": "]"}]}
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [(s.index, s.name, s.id) for s in starts] == [(i, c["function"]["name"], c["id"])
                                                         for i, c in enumerate(whole)]
    for i, call in enumerate(whole):  # the streamed pieces join into the same JSON
        assert "".join(p.text for p in pieces if isinstance(p, CallArguments) and p.index == i) == \
            call["function"]["arguments"]
    assert calls.flush() == "" and [c["index"] for c in calls.calls(streaming=True)] == [0, 1]


def test_json_calls_cut_short():
    calls, _ = feed_in_pieces('{"name": "get_weather", "arguments": {"city": "Par', 4)
    assert calls.calls()[0]["function"]["arguments"] == '{"city": "Par' and calls.flush() == ""
    nameless, pieces = feed_in_pieces('{"na', 1)
    assert nameless.calls() == [] and pieces == [] and nameless.flush() == '{"na'  # shown as text


@dataclass
class Stats:
    finish_reason: str = "stop"
    prompt_tokens: int = 5
    cached_tokens: int = 0
    generated_tokens: int = 9
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    stop_sequence: str | None = None


def data_events(pieces: list[bytes]) -> list[dict]:
    text = b"".join(pieces).decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_openai_format_writes_a_forced_call():
    calls, pieces = feed_in_pieces('{"name": "get_weather", "arguments": {"city": "Paris"}}', 5)
    fmt = OpenAIFormat("m", True, 5, False, False)
    out = fmt.opening(0) + fmt.call_pieces(pieces)
    out += fmt.ending(Ending(Stats(), None, calls.flush(), calls.calls(streaming=True), []))
    events = data_events(out)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    deltas = [e["choices"][0]["delta"]["tool_calls"][0] for e in events if "tool_calls" in e["choices"][0]["delta"]]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    body = OpenAIFormat("m", True, 5, False, False).whole(Whole("", calls.calls(), Stats(), [], [], None))
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["refusal"] is None and body["choices"][0]["finish_reason"] == \
        "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    cut = OpenAIFormat("m", True, 5, False, False).whole(Whole("", calls.calls(), Stats("length"), [], [], None))
    assert cut["choices"][0]["finish_reason"] == "length"


def test_anthropic_format_streams_tool_use_as_input_json_deltas():
    calls, pieces = feed_in_pieces('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', 7)
    fmt = AnthropicFormat("m", 5)
    out = fmt.call_pieces(pieces) + fmt.ending(Ending(Stats(), None, calls.flush(), calls.calls(streaming=True), []))
    events = [json.loads(b.decode().split("data: ", 1)[1]) for b in out if b]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-1] == "message_stop"
    block = events[1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"].startswith("toolu_")
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


# -- the real SmolLM2 through the official clients ------------------------------------------
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")


class Person(pydantic.BaseModel):
    """A small schema whose strings and numbers are bounded, so a reply ends soon."""

    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


PERSON_PROMPT = [{"role": "user", "content": "Alice is 30 years old. Describe her as JSON with name and age."}]
WEATHER_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}
BAD_SCHEMA = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}  # not implemented


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from justfit import Engine
    from tests.helpers.server_harness import LiveServer

    live = LiveServer(Engine(str(smollm2_gguf)))
    live.seen = []  # the constraint of each request submitted, as the engine gets it
    submit = live.server.submit

    def recording(tokens, opts, route="", request=None):
        live.seen.append(opts.sampling.constraint)
        return submit(tokens, opts, route, request)

    live.server.submit = recording
    yield live
    live.close()


@pytest.fixture(scope="module")
def oai(smol):
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(smol):
    return anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0)


def last_constraint(smol) -> OutputConstraint | None:
    return smol.seen[-1]


def test_every_api_hands_its_constraint_to_the_engine(smol, oai, claude):
    from tests.helpers.server_harness import request

    schema = Person.model_json_schema()
    oai.chat.completions.create(model="default", messages=PERSON_PROMPT, max_tokens=1,
                                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert last_constraint(smol) == OutputConstraint("json_schema", json.dumps(schema))
    oai.completions.create(model="default", prompt="{", max_tokens=1, extra_body={"response_format": {
        "type": "json_object"}})
    assert last_constraint(smol) == OutputConstraint("json_object")
    for path, body in (("/api/chat", {"messages": PERSON_PROMPT}), ("/api/generate", {"prompt": "Alice?"})):
        status, _, _ = request(smol, "POST", path, {**body, "format": "json", "stream": False,
                                                    "options": {"num_predict": 1}})
        assert status == 200 and last_constraint(smol) == OutputConstraint("json_object")
    claude.messages.create(model="claude-x", max_tokens=1, messages=PERSON_PROMPT,
                           output_config={"format": {"type": "json_schema", "schema": schema}})
    assert last_constraint(smol) == OutputConstraint("json_schema", json.dumps(schema))
    claude.messages.create(model="claude-x", max_tokens=1, messages=WEATHER_PROMPT, tools=[ANTHROPIC_WEATHER],
                           tool_choice={"type": "tool", "name": "get_weather"})
    assert json.loads(last_constraint(smol).text)["type"] == "array"


def test_tool_choice_none_and_auto_leave_the_text_free(smol, oai):
    r = oai.chat.completions.create(model="default", messages=WEATHER_PROMPT, max_tokens=8, temperature=0,
                                    tools=[WEATHER], tool_choice="none")
    message = r.choices[0].message
    assert last_constraint(smol) is None and message.tool_calls is None and message.content
    assert message.refusal is None
    r = oai.chat.completions.create(model="default", messages=WEATHER_PROMPT, max_tokens=8, temperature=0,
                                    tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert last_constraint(smol) is None and r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_parse_returns_the_model(smol, oai):
    r = oai.chat.completions.parse(model="default", messages=PERSON_PROMPT, response_format=Person,
                                   max_tokens=60, temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert r.choices[0].message.refusal is None


def test_json_object_whole_and_streamed_agree(smol, oai):
    args = dict(model="default", messages=PERSON_PROMPT, max_tokens=60, temperature=0,
                response_format={"type": "json_object"})
    whole = oai.chat.completions.create(**args).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**args, stream=True)
                       if c.choices)
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(whole.message.content), dict)
    assert streamed == whole.message.content


def test_completions_take_response_format(smol, oai):
    schema = Person.model_json_schema()
    r = oai.completions.create(model="default", prompt="Alice is 30. As JSON:", max_tokens=60, temperature=0,
                               extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                   "name": "person", "schema": schema}}})
    assert r.choices[0].finish_reason == "stop"
    Person.model_validate_json(r.choices[0].text)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_whole_and_streamed(smol, oai, choice):
    args = dict(model="default", messages=WEATHER_PROMPT, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                tool_choice=choice, parallel_tool_calls=False)
    r = oai.chat.completions.create(**args).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None, r
    (call,) = r.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} if call.function.name == "get_weather" else {"zone"}
    chunks = [c.choices[0] for c in oai.chat.completions.create(**args, stream=True) if c.choices]
    deltas = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"


def test_parallel_tool_calls_are_one_or_more(smol, oai):
    r = oai.chat.completions.create(model="default", messages=WEATHER_PROMPT, max_tokens=120, temperature=0,
                                    tools=[WEATHER], tool_choice="required").choices[0]
    assert r.message.tool_calls and all(json.loads(c.function.arguments).keys() == {"city"}
                                        for c in r.message.tool_calls if r.finish_reason == "tool_calls")


def test_max_tokens_too_small_is_length_with_partial_text(smol, oai):
    r = oai.chat.completions.create(
        model="default", messages=PERSON_PROMPT, max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


def test_ollama_format_schema_through_its_client(smol):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=smol.url)
    r = client.chat(model="default", messages=PERSON_PROMPT, format=Person.model_json_schema(),
                    options={"temperature": 0, "num_predict": 60})
    Person.model_validate_json(r.message.content)
    streamed = "".join(part.message.content for part in client.chat(
        model="default", messages=PERSON_PROMPT, format=Person.model_json_schema(), stream=True,
        options={"temperature": 0, "num_predict": 60}))
    assert streamed == r.message.content
    g = client.generate(model="default", prompt="Alice is 30.", format="json", options={"temperature": 0,
                                                                                      "num_predict": 60})
    assert g.done_reason != "stop" or isinstance(json.loads(g.response), dict)


def test_anthropic_parse_and_forced_tool_use(smol, claude):
    r = claude.messages.parse(model="claude-x", max_tokens=60, messages=PERSON_PROMPT, output_format=Person,
                              extra_body={"temperature": 0})
    assert isinstance(r.parsed_output, Person) and r.stop_reason == "end_turn"
    args = dict(model="claude-x", max_tokens=80, messages=WEATHER_PROMPT, tools=[ANTHROPIC_WEATHER],
                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                extra_body={"temperature": 0})
    m = claude.messages.create(**args)
    (block,) = m.content
    assert m.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "get_weather"
    assert set(block.input) == {"city"}
    with claude.messages.stream(**args) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert json.loads(partial) == block.input and final.content[0].input == block.input


def test_invalid_schema_is_a_400_naming_the_keyword_on_every_api(smol):
    from tests.helpers.server_harness import request

    status, _, text = request(smol, "POST", "/v1/chat/completions", {
        "messages": PERSON_PROMPT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": BAD_SCHEMA}}})
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == "invalid_grammar" and err["param"] == "response_format"
    assert '"if"' in err["message"], err
    for field, value, named in (("grammar", "root ::= foo", "foo"), ("regex", "(a", "unclosed group")):
        status, _, text = request(smol, "POST", "/v1/chat/completions", {"messages": PERSON_PROMPT, field: value})
        err = json.loads(text)["error"]
        assert status == 400 and err["code"] == "invalid_grammar" and err["param"] == field and named in err["message"]
    status, _, text = request(smol, "POST", "/api/chat", {"messages": PERSON_PROMPT, "format": BAD_SCHEMA})
    assert status == 400 and "if" in json.loads(text)["error"]
    status, _, text = request(smol, "POST", "/v1/messages", {
        "model": "claude-x", "max_tokens": 8, "messages": PERSON_PROMPT,
        "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}})
    body = json.loads(text)
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in body["error"]["message"] and "if" in body["error"]["message"]

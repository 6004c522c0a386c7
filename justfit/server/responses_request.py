"""OpenAI's Responses API request, checked and translated: `input` (a string, or items:
messages, function calls and their outputs; reasoning items are accepted and ignored)
into conversation items in one stored shape, those items (with `instructions` first)
into chat-template messages, flat function tools, tool_choice and `text.format` into
chat completions' forms for justfit.server.structured (the constraint and tool mode),
and the sampling options. Every wrong field is a 400 naming it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

from justfit.config import OutputConstraint, SamplingParams
from justfit.server.schema import BadRequest, Options, get
from justfit.server.structured import response_format_constraint, schema_constraint, tool_choice_constraint

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
IGNORED_ITEMS = ("reasoning",)  # a reasoning model's own notes: nothing a local model can read back
# Fields that ask for what this server does not do: refused, never silently dropped.
REFUSED = {"background": "background responses", "conversation": "conversations",
           "prompt": "prompt templates"}


@dataclass
class ResponsesRequest:
    """A checked POST /v1/responses body."""

    items: list[dict]  # this request's input items, in the stored shape (each with an id)
    instructions: str | None
    previous_response_id: str | None
    store: bool
    opts: Options
    echo: dict = field(default_factory=dict)  # request fields the response object repeats


def new_id(prefix: str) -> str:
    """A fresh object id such as `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_parts(content, path: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text; a refusal's text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"'{path}' must be a string or an array of content parts", path)
    out = []
    for i, part in enumerate(content):
        at = f"{path}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            out.append(get(part, "text", str, where=f"{at}."))
        elif kind == "refusal":
            out.append(get(part, "refusal", str, where=f"{at}."))
        else:
            raise BadRequest(f"'{at}': only text content parts are supported (input_text, output_text)", at)
    return "".join(out)


def _message(item: dict, path: str) -> dict:
    role = get(item, "role", str, where=f"{path}.")
    if role not in ROLES:
        raise BadRequest(f"'{path}.role' must be one of {', '.join(ROLES)}, not {role!r}", f"{path}.role")
    text = _text_parts(item.get("content", ""), f"{path}.content")
    part = {"type": "output_text", "text": text, "annotations": []} if role == "assistant" else \
        {"type": "input_text", "text": text}
    return {"type": "message", "id": _item_id(item, path, "msg"), "role": role, "content": [part],
            "status": "completed"}


def _arguments(item: dict, path: str) -> str:
    """A function call's arguments: JSON text of an object (what the model wrote, as sent)."""
    args = get(item, "arguments", str, "", where=f"{path}.")
    try:
        parsed = json.loads(args) if args.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        raise BadRequest(f"'{path}.arguments' is not valid JSON", f"{path}.arguments") from None
    if not isinstance(parsed, dict):
        raise BadRequest(f"'{path}.arguments' must be a JSON object", f"{path}.arguments")
    return args


def _item_id(item: dict, path: str, prefix: str) -> str:
    return get(item, "id", str, None, where=f"{path}.") or new_id(prefix)


def input_items(body: dict) -> list[dict]:
    """`input` as conversation items in the stored shape: a string is one user message."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user",
                 "content": [{"type": "input_text", "text": value}], "status": "completed"}]
    if not isinstance(value, list):
        raise BadRequest("'input' must be a string or an array of input items", "input")
    out = []
    for i, item in enumerate(value):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"'{path}' must be an object", path)
        kind = get(item, "type", str, "message", where=f"{path}.")
        if kind == "message":
            out.append(_message(item, path))
        elif kind == "function_call":
            out.append({"type": "function_call", "id": _item_id(item, path, "fc"),
                        "call_id": get(item, "call_id", str, where=f"{path}."),
                        "name": get(item, "name", str, where=f"{path}."), "arguments": _arguments(item, path),
                        "status": "completed"})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"type": "function_call_output", "id": _item_id(item, path, "fco"),
                        "call_id": get(item, "call_id", str, where=f"{path}."),
                        "output": _text_parts(output if output is not None else "", f"{path}.output"),
                        "status": "completed"})
        elif kind not in IGNORED_ITEMS:
            raise BadRequest(f"'{path}': {kind!r} items are not supported here (message, function_call, "
                             "function_call_output and reasoning are)", f"{path}.type")
    return out


def item_text(item: dict) -> str:
    """A stored message item's text."""
    return "".join(p.get("text", "") for p in item.get("content", []))


def arguments_object(text: str) -> dict:
    """A call's arguments as the object templates want; text that is not a JSON object
    (a truncated call the model wrote) is kept under "value"."""
    try:
        parsed = json.loads(text) if text.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return {"value": text}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Conversation items (stored shape) as chat-template messages: `instructions` as
    the system message first, function calls as the assistant's tool_calls (joined to
    the assistant message just before them), their outputs as "tool" messages."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    names = {}  # call_id -> function name, for the tool messages templates label
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": item_text(item)})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": arguments_object(item["arguments"])}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            msg = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in names:
                msg["name"] = names[item["call_id"]]
            out.append(msg)
    return out


def chat_tools(body: dict) -> list[dict] | None:
    """Responses' flat function tools in chat completions' form; tools of other types
    (a hosted search, a shell the client runs itself) are left out: this server can
    only offer functions."""
    tools = get(body, "tools", list, None)
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise BadRequest(f"'tools[{i}]' must be an object", f"tools[{i}]")
        if get(t, "type", str, where=f"tools[{i}].") != "function":
            continue
        out.append({"type": "function", "function": {
            "name": get(t, "name", str, where=f"tools[{i}]."),
            "description": get(t, "description", str, "", where=f"tools[{i}]."),
            "parameters": get(t, "parameters", dict, {"type": "object", "properties": {}}, where=f"tools[{i}]."),
            "strict": get(t, "strict", bool, False, where=f"tools[{i}].")}})
    return out or None


def chat_tool_choice(choice):
    """Responses' tool_choice in chat completions' form: a named function is flat here
    (`{"type": "function", "name"}`), allowed_tools holds its mode and tools directly."""
    if not isinstance(choice, dict):
        return choice
    kind = get(choice, "type", str, where="tool_choice.")
    if kind == "function":
        return {"type": "function", "function": {"name": get(choice, "name", str, where="tool_choice.")}}
    if kind == "allowed_tools":
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode", "auto"),
                                                           "tools": get(choice, "tools", list, where="tool_choice.")}}
    raise BadRequest(f"'tool_choice.type' must be function or allowed_tools here, not {kind!r}", "tool_choice.type")


def text_format_constraint(body: dict) -> OutputConstraint | None:
    """`text.format`: text (free), json_object, or json_schema with its schema flat
    (`{"type": "json_schema", "name", "schema", "strict"}`; the schema is followed
    whether it says strict or not)."""
    text = get(body, "text", dict, {})
    fmt = get(text, "format", dict, None, where="text.")
    if fmt is None:
        return None
    kind = get(fmt, "type", str, where="text.format.")
    if kind != "json_schema":
        return response_format_constraint(fmt, "text.format")
    get(fmt, "name", str, "", where="text.format.")
    get(fmt, "strict", bool, False, where="text.format.")
    schema = fmt.get("schema")
    return OutputConstraint("json_object") if schema is None else schema_constraint(schema, "text.format.schema")


def structure(body: dict, opts: Options) -> Options:
    """`opts` with the tools the template shows, how the reply's calls come about
    (tool_choice) and the one constraint the reply follows (text.format, or a forced
    call): justfit.server.structured, from the Responses shapes."""
    found = []
    fmt = text_format_constraint(body)
    if fmt is not None:
        found.append(("text.format", fmt))
    forced, mode = tool_choice_constraint(chat_tools(body), chat_tool_choice(body.get("tool_choice")),
                                          get(body, "parallel_tool_calls", bool, True))
    if forced is not None:
        found.append(("tool_choice", forced))
    if len(found) > 1:
        raise BadRequest("'text.format' and 'tool_choice' each constrain the reply: send at most one of them",
                         "tool_choice", code="conflicting_constraints")
    field, constraint = found[0] if found else (None, None)
    return replace(opts, sampling=replace(opts.sampling, constraint=constraint), constraint_field=field,
                   tools=mode.tools, tool_mode=mode)


def _sampling(body: dict, default_max_tokens: int, defaults: SamplingParams) -> tuple[SamplingParams, bool]:
    limit = get(body, "max_output_tokens", int, None, lo=1)
    try:
        sp = SamplingParams(
            temperature=get(body, "temperature", float, defaults.temperature, lo=0, hi=2),
            top_p=get(body, "top_p", float, defaults.top_p, lo=0, hi=1),
            top_k=get(body, "top_k", int, defaults.top_k, lo=0),  # extension, as on chat completions
            min_p=get(body, "min_p", float, defaults.min_p, lo=0, hi=1),
            repetition_penalty=defaults.repetition_penalty,
            seed=get(body, "seed", int, None),
            max_tokens=limit if limit is not None else default_max_tokens,
            ignore_eos=get(body, "ignore_eos", bool, False),  # extension: benchmarks
            speculate=get(body, "speculate", bool, True),  # extension: false decodes one token per step
        )
    except ValueError as e:  # e.g. top_p 0
        raise BadRequest(str(e), None) from None
    return sp, limit is not None


def responses_request(body: dict, default_max_tokens: int, defaults: SamplingParams = SamplingParams()) -> ResponsesRequest:
    """A POST /v1/responses body, checked; what it does not say is sampled as
    `defaults` (the model's recommendation, engine.default_sampling)."""
    for name, what in REFUSED.items():
        if body.get(name) not in (None, False):
            raise BadRequest(f"{what} are not supported here", name, code=f"unsupported_{name}")
    if "input" not in body:
        raise BadRequest("'input' is required", "input")
    items = input_items(body)
    instructions = get(body, "instructions", str, None)
    previous = get(body, "previous_response_id", str, None)
    store = get(body, "store", bool, True)
    sp, given = _sampling(body, default_max_tokens, defaults)
    opts = structure(body, Options(sp, given, get(body, "stream", bool, False)))
    tools = get(body, "tools", list, [])
    text = {"format": get(get(body, "text", dict, {}), "format", dict, {"type": "text"}, where="text.")}
    echo = {"instructions": instructions, "max_output_tokens": sp.max_tokens if given else None,
            "metadata": get(body, "metadata", dict, {}), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "store": store, "temperature": sp.temperature, "top_p": sp.top_p,
            "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": [t for t in tools if isinstance(t, dict)],
            "truncation": "disabled", "user": get(body, "user", str, None),
            "reasoning": {"effort": None, "summary": None}}
    return ResponsesRequest(items, instructions, previous, store, opts, echo)

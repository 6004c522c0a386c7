"""Anthropic's Messages API request, translated: messages (text, tool_use, tool_result
blocks) into chat-template messages, tool definitions into the template's (OpenAI's)
form, and the sampling options."""

from __future__ import annotations

from justfit.config import SamplingParams
from justfit.server.schema import BadRequest, Options, get, session_name

# Block types a client may send back that carry nothing for a local model: the model's
# own earlier reasoning (never produced here) and server-side tool results.
IGNORED_BLOCKS = ("thinking", "redacted_thinking")


def _blocks(content, path: str) -> list[dict]:
    """Message content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"'{path}' must be a string or an array of content blocks", path)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"'{path}[{i}]' must be a content block with a 'type'", f"{path}[{i}]")
    return content


def _result_text(content, path: str) -> str:
    """A tool_result's content: a string or text blocks."""
    if content is None:
        return ""
    parts = []
    for i, block in enumerate(_blocks(content, path)):
        if block["type"] != "text":
            raise BadRequest(f"'{path}[{i}]': only text tool results are supported", f"{path}[{i}]")
        parts.append(get(block, "text", str, where=f"{path}[{i}]."))
    return "".join(parts)


def system_text(body: dict) -> str | None:
    """`system`: a string or text blocks (their cache_control hints are ignored)."""
    system = body.get("system")
    if system is None:
        return None
    return _result_text(system, "system")


def chat_messages(body: dict) -> list[dict]:
    """Anthropic messages as chat-template messages: text joined, tool_use blocks as the
    assistant's tool_calls, tool_result blocks as "tool" messages."""
    msgs = get(body, "messages", list)
    if not msgs:
        raise BadRequest("'messages' must not be empty", "messages")
    system = system_text(body)
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{where}' must be an object", where)
        role = get(m, "role", str, where=f"{where}.")
        if role not in ("user", "assistant"):
            raise BadRequest(f"'{where}.role' must be user or assistant, not {role!r}", f"{where}.role")
        text, calls, results = [], [], []
        for j, block in enumerate(_blocks(m.get("content"), f"{where}.content")):
            at, kind = f"{where}.content[{j}]", block["type"]
            if kind == "text":
                text.append(get(block, "text", str, where=f"{at}."))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": get(block, "id", str, where=f"{at}."), "type": "function",
                              "function": {"name": get(block, "name", str, where=f"{at}."),
                                           "arguments": get(block, "input", dict, {}, where=f"{at}.")}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": get(block, "tool_use_id", str, where=f"{at}."),
                                "content": _result_text(block.get("content"), f"{at}.content")})
            elif kind not in IGNORED_BLOCKS:
                raise BadRequest(f"'{at}': {kind!r} blocks are not supported here (text, tool_use from the "
                                 "assistant and tool_result from the user are)", at)
        out.extend(results)  # tool results answer the previous turn's calls: they come first
        if text or calls or not results:
            msg = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def openai_tools(body: dict) -> list[dict] | None:
    """Anthropic tool definitions in the chat template's (OpenAI's) form; none when
    tool_choice is "none"."""
    tools = get(body, "tools", list, None)
    choice = get(body, "tool_choice", dict, {})
    if not tools or choice.get("type") == "none":
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise BadRequest(f"'tools[{i}]' must be an object", f"tools[{i}]")
        if t.get("type") not in (None, "custom"):  # Anthropic's server tools (web search...) run at Anthropic
            raise BadRequest(f"'tools[{i}]': tool type {t['type']!r} is not available here", f"tools[{i}].type")
        out.append({"type": "function", "function": {
            "name": get(t, "name", str, where=f"tools[{i}]."),
            "description": get(t, "description", str, "", where=f"tools[{i}]."),
            "parameters": get(t, "input_schema", dict, {"type": "object"}, where=f"tools[{i}].")}})
    return out


def anthropic_options(body: dict, defaults: SamplingParams = SamplingParams()) -> Options:
    """max_tokens is required, as Anthropic's is; temperature, top_p and top_k come from
    the body (newer clients send them only through extra_body), else from `defaults`
    (the model's recommendation, engine.default_sampling)."""
    stops = get(body, "stop_sequences", list, [])
    if len(stops) > 16 or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop_sequences' must be an array of at most 16 strings", "stop_sequences")
    try:
        sp = SamplingParams(
            temperature=get(body, "temperature", float, defaults.temperature, lo=0, hi=2),
            top_p=get(body, "top_p", float, defaults.top_p, lo=0, hi=1),
            top_k=get(body, "top_k", int, defaults.top_k, lo=0),
            min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty,
            max_tokens=get(body, "max_tokens", int, lo=1),
            stop=tuple(stops),
            speculate=get(body, "speculate", bool, True),  # extension (extra_body): false decodes one token per step
        )
    except ValueError as e:  # top_p 0
        raise BadRequest(str(e), None) from None
    metadata = get(body, "metadata", dict, {})
    return Options(sp, True, get(body, "stream", bool, False),
                   session=session_name(body.get("session")) or session_name(metadata.get("session"),
                                                                                "metadata.session"),
                   tools=openai_tools(body))

"""Request bodies, checked: every wrong field is a 400 that names it. Unknown fields
are ignored (clients send many); known ones must have the right type and range."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from justfit.config import SamplingParams
from justfit.server.tools import ToolMode

_MISSING = object()
ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(Exception):
    """A client error: HTTP `status`, OpenAI-style `type`/`code`, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.details = type, code, details or {}

    def body(self) -> dict:
        """OpenAI's error body for this error."""
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.details:
            err["details"] = self.details
        return {"error": err}


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or BadRequest."""
    try:
        body = json.loads(raw or b"null")
    except json.JSONDecodeError as e:  # where, in our words; never the exception's text
        raise BadRequest(f"request body is not valid JSON (line {e.lineno}, column {e.colno})", "body") from None
    except (ValueError, UnicodeDecodeError):  # not UTF-8, or a 5000-digit integer
        raise BadRequest("request body is not valid JSON: not UTF-8, or a number too long", "body") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", "body") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", "body")
    return body


def _type_name(types) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in (types if isinstance(types, tuple) else (types,)))


def get(body: dict, name: str, types, default: Any = _MISSING, *, lo: float | None = None,
        hi: float | None = None, where: str = "") -> Any:
    """body[name], checked; `default` when absent or null (required if none given)."""
    path = f"{where}{name}"
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise BadRequest(f"'{path}' is required", path)
        return default
    types = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        ok, value = abs(value) < 1e300, float(value)
    if ok and isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{path}' must be a finite number", path)
    if not ok:
        raise BadRequest(f"'{path}' must be {_type_name(types)}, not {type(value).__name__}", path)
    if lo is not None and value < lo or hi is not None and value > hi:
        rng = f"between {lo} and {hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise BadRequest(f"'{path}' must be {rng}, not {value}", path)
    return value


SESSION_NAME_CHARS = 256


def session_name(value, path: str = "session") -> str | None:
    """A session name a client sent: text of 1-256 characters, valid Unicode (no lone
    surrogates) and no control characters, so every tool can show and name it; None
    when absent. On disk it is only ever hashed (statetrans.sessions)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"'{path}' must be a string, not {type(value).__name__}", path)
    if not 1 <= len(value) <= SESSION_NAME_CHARS:
        raise BadRequest(f"'{path}' must be 1 to {SESSION_NAME_CHARS} characters", path)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{path}' is not valid Unicode (a lone surrogate)", path) from None
    if any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 for c in value):
        raise BadRequest(f"'{path}' must not contain control characters", path)
    return value


def token_ids(value, vocab: int, path: str) -> list[int]:
    """A list of token ids, each in [0, vocab)."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"'{path}' must be an array of token ids", path)
    if any(not 0 <= t < vocab for t in value):
        raise BadRequest(f"'{path}' token ids must be in [0, {vocab})", path)
    return list(value)


def _stop(value, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 16:
        return tuple(value)
    raise BadRequest(f"'{path}' must be a string or an array of at most 16 strings", path)


def _text(content, path: str) -> str:
    """Message content: a string or OpenAI content parts (text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise BadRequest(f"'{path}[{i}]': only text content parts are supported", f"{path}[{i}]")
            out.append(get(part, "text", str, where=f"{path}[{i}]."))
        return "".join(out)
    raise BadRequest(f"'{path}' must be a string or an array of content parts", path)


def messages(body: dict) -> list[dict]:
    """The body's `messages`, checked and normalized for the chat template."""
    msgs = get(body, "messages", list)
    if not msgs:
        raise BadRequest("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]."
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = get(m, "role", str, where=where)
        if role not in ROLES:
            raise BadRequest(f"'{where}role' must be one of {', '.join(ROLES)}, not {role!r}", f"{where}role")
        msg = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), f"{where}content")}
        for key in ("name", "tool_call_id"):
            if key in m and m[key] is not None:
                msg[key] = get(m, key, str, where=where)
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = [_tool_call(tc, f"{where}tool_calls[{j}]")
                                 for j, tc in enumerate(get(m, "tool_calls", list, where=where))]
        out.append(msg)
    return out


def _tool_call(tc, path: str) -> dict:
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        raise BadRequest(f"'{path}' must be an object with a 'function'", path)
    fn = tc["function"]
    args = fn.get("arguments") or {}
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string; templates want objects
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise BadRequest(f"'{path}.function.arguments' is not valid JSON", f"{path}.function.arguments") from None
    return {"id": tc.get("id"), "type": "function",
            "function": {"name": get(fn, "name", str, where=f"{path}.function."), "arguments": args}}


@dataclass
class Options:
    """What a generation request asks for, in the engine's terms."""

    sampling: SamplingParams
    max_tokens_given: bool
    stream: bool = False
    include_usage: bool = False
    session: str | None = None
    tools: list | None = None  # the tool definitions the chat template shows
    extra: dict = field(default_factory=dict)
    tool_mode: ToolMode = ToolMode()  # how the reply's tool calls come about (justfit.server.structured)
    constraint_field: str | None = None  # the request field sampling.constraint came from


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives to report per token (None: no logprobs). Chat sends
    `logprobs: true` and `top_logprobs` (0-20); completions `logprobs` (0-5)."""
    if not chat:
        return get(body, "logprobs", int, None, lo=0, hi=5)
    top = get(body, "top_logprobs", int, None, lo=0, hi=20)
    if not get(body, "logprobs", bool, False):
        if top:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def openai_options(body: dict, default_max_tokens: int, chat: bool = True,
                   defaults: SamplingParams = SamplingParams()) -> Options:
    """A chat (or, `chat` False, a legacy completions) request's options; what it does
    not say is sampled as `defaults` (the model's recommendation, engine.default_sampling)."""
    n = get(body, "n", int, 1)
    if n != 1:
        raise BadRequest("'n' must be 1: one completion per request", "n")
    max_tokens = get(body, "max_completion_tokens", int, None, lo=0)
    max_tokens = get(body, "max_tokens", int, max_tokens, lo=0)
    given = max_tokens is not None
    stream = get(body, "stream", bool, False)
    stream_options = get(body, "stream_options", dict, {})
    try:
        sp = SamplingParams(
            temperature=get(body, "temperature", float, defaults.temperature, lo=0, hi=2),
            top_p=get(body, "top_p", float, defaults.top_p, lo=0, hi=1),
            top_k=get(body, "top_k", int, defaults.top_k, lo=0),
            min_p=get(body, "min_p", float, defaults.min_p, lo=0, hi=1),
            repetition_penalty=get(body, "repetition_penalty", float, defaults.repetition_penalty, lo=0.01, hi=10),
            seed=get(body, "seed", int, None),
            max_tokens=max_tokens if given else default_max_tokens,
            stop=_stop(body.get("stop"), "stop"),
            ignore_eos=get(body, "ignore_eos", bool, False),  # extension: benchmarks
            frequency_penalty=get(body, "frequency_penalty", float, 0.0, lo=-2, hi=2),
            presence_penalty=get(body, "presence_penalty", float, 0.0, lo=-2, hi=2),
            logprobs=_logprobs(body, chat),
            speculate=get(body, "speculate", bool, True),  # extension: false decodes one token per step
        )
    except ValueError as e:  # e.g. top_p 0
        raise BadRequest(str(e), None) from None
    tools = get(body, "tools", list, None)
    return Options(sp, given, stream, get(stream_options, "include_usage", bool, False, where="stream_options."),
                   session_name(body.get("session")), tools or None)


def ollama_options(body: dict, default_max_tokens: int, defaults: SamplingParams = SamplingParams()) -> Options:
    """An Ollama request's options in the engine's terms, `defaults` (the model's
    recommendation, as a Modelfile's parameters are Ollama's) where absent."""
    opts = get(body, "options", dict, {})
    w = "options."
    num_predict = get(opts, "num_predict", int, None, lo=-2, where=w)
    given = num_predict is not None and num_predict >= 0
    try:
        sp = SamplingParams(
            temperature=get(opts, "temperature", float, defaults.temperature, lo=0, hi=2, where=w),
            top_p=get(opts, "top_p", float, defaults.top_p, lo=0, hi=1, where=w),
            top_k=get(opts, "top_k", int, defaults.top_k, lo=0, where=w),
            min_p=get(opts, "min_p", float, defaults.min_p, lo=0, hi=1, where=w),
            repetition_penalty=get(opts, "repeat_penalty", float, defaults.repetition_penalty, lo=0.01, hi=10,
                                   where=w),
            seed=get(opts, "seed", int, None, where=w),
            max_tokens=num_predict if given else default_max_tokens,
            stop=_stop(opts.get("stop"), "options.stop"),
            speculate=get(opts, "speculate", bool, True, where=w),  # extension, where Ollama's clients pass options
        )
    except ValueError as e:
        raise BadRequest(str(e), "options") from None
    return Options(sp, given, get(body, "stream", bool, True), tools=get(body, "tools", list, None) or None)

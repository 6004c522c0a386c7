"""The fuzz cases `bench.serve fuzz` sends: broken JSON, HTTP-level abuse and
wrong-typed or out-of-range fields on every route, generated deterministically from
a seed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

ROUTES = ["/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate", "/api/show", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/responses"]
_ANTHROPIC = ["model", "max_tokens", "messages", "messages.0", "messages.0.role", "messages.0.content",
              "messages.0.content.0", "messages.0.content.0.type", "messages.0.content.0.text",
              "messages.0.content.0.input", "messages.0.content.0.tool_use_id", "messages.0.content.0.content",
              "messages.0.content.0.content.0", "system", "system.0", "system.0.text", "stop_sequences",
              "temperature", "top_p", "top_k", "stream", "tools", "tools.0", "tools.0.name", "tools.0.type",
              "tools.0.input_schema", "tool_choice", "tool_choice.type", "metadata", "metadata.session",
              "session", "thinking"]
FIELDS = {  # every known field, as a path into the body
    "/v1/chat/completions": ["model", "messages", "messages.0", "messages.0.role", "messages.0.content",
                             "messages.0.content.0", "messages.0.content.0.text", "messages.0.tool_calls",
                             "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
                             "seed", "n", "stop", "stream", "stream_options", "stream_options.include_usage",
                             "tools", "frequency_penalty", "repetition_penalty", "session"],
    "/v1/completions": ["model", "prompt", "prompt.0", "max_tokens", "temperature", "top_p", "top_k", "seed",
                        "n", "stop", "stream", "stream_options", "echo", "logprobs", "best_of", "session"],
    "/api/chat": ["model", "messages", "messages.0.role", "messages.0.content", "stream", "tools", "options",
                  "options.num_predict", "options.temperature", "options.top_p", "options.top_k",
                  "options.seed", "options.stop", "options.repeat_penalty", "options.min_p"],
    "/api/generate": ["model", "prompt", "system", "context", "raw", "stream", "options", "options.num_predict",
                      "options.temperature", "options.top_p", "options.top_k", "options.seed", "options.stop"],
    "/api/show": ["model", "name"],
    "/v1/messages": _ANTHROPIC,
    "/v1/messages/count_tokens": _ANTHROPIC,
    "/v1/responses": ["model", "input", "input.0", "input.0.type", "input.0.role", "input.0.content",
                      "input.0.content.0", "input.0.content.0.type", "input.0.content.0.text", "input.0.call_id",
                      "input.0.name", "input.0.arguments", "input.0.output", "instructions", "max_output_tokens",
                      "temperature", "top_p", "stream", "store", "previous_response_id", "tools", "tools.0",
                      "tools.0.type", "tools.0.name", "tools.0.parameters", "tool_choice", "text", "text.format",
                      "text.format.type", "parallel_tool_calls", "metadata", "reasoning", "background", "user"],
}
WRONG = [None, True, False, 0, -1, 3, 10**12, -10**12, 2**64, 1.5, -0.5, 5.0, float("nan"), float("inf"),
         float("-inf"), "", "x", "x" * 100_000, [], [1], [-5, 10**9], ["x"] * 100, {}, {"a": 1}, [[[]]],
         {"type": "text"}, {"type": "image_url", "image_url": {"url": "http://x"}}, [{"type": "function"}]]
OUT_OF_RANGE = [("max_tokens", -1), ("max_tokens", 10**12), ("temperature", 5), ("top_p", 0), ("n", 3),
                ("stop", [f"s{i}" for i in range(100)]), ("model", "no-such-model"), ("model", "gpt-4o:latest"),
                ("messages.0.role", "r" * 100_000), ("options.num_predict", -3), ("options.temperature", 5),
                ("max_tokens", 0), ("stop_sequences", ["s"] * 17), ("messages.0.role", "system"),
                ("messages.0.content.0.type", "image"), ("messages.0.content.0.type", "tool_result"),
                ("messages.0.content.0.type", "tool_use"), ("tools.0.type", "web_search_20250305"),
                ("model", "claude-opus-4-1"), ("system", [{"type": "image"}])]


@dataclass
class Case:
    desc: str
    path: str
    body: bytes = b""
    method: str = "POST"
    content_type: str = "application/json"


def base_body(path: str) -> dict:
    """A valid request; max_tokens 2 (and the server's default 4) keep accidents fast."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    opts = {"num_predict": 2, "temperature": 0}
    anthropic = {"model": "default", "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], "temperature": 0}
    return {"/v1/chat/completions": {"model": "default", "messages": msgs, "max_tokens": 2, "temperature": 0},
            "/v1/completions": {"model": "default", "prompt": ["Say hi."], "max_tokens": 2, "temperature": 0},
            "/api/chat": {"model": "default", "messages": msgs, "stream": False, "options": opts},
            "/api/generate": {"model": "default", "prompt": "Say hi.", "stream": False, "options": opts},
            "/api/show": {"model": "default"},
            "/v1/messages": anthropic, "/v1/messages/count_tokens": anthropic,
            "/v1/responses": {"model": "default", "instructions": "Be brief.", "max_output_tokens": 2, "temperature": 0,
                              "input": [{"type": "message", "role": "user",
                                         "content": [{"type": "input_text", "text": "Say hi."}]}]}}[path]


def put(body: dict, dotted: str, value) -> dict:
    """body with the field at `dotted` ("messages.0.role") set to value."""
    *head, last = dotted.split(".")
    node = body
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[int(last) if isinstance(node, list) else last] = value
    return body


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN / Infinity go out as literals, on purpose


def raw_cases(path: str, rng: random.Random) -> list[Case]:
    """Broken JSON and HTTP-level abuse for one route."""
    good = dumps(base_body(path))
    cut, nest = rng.randrange(1, len(good)), b"[" * 10_000 + b"]" * 10_000
    return [Case(f"truncated JSON at {cut}", path, good[:cut]),
            Case("invalid UTF-8 in a string", path, good.replace(b"default", b"def\xff\xfeault")),
            Case("empty body", path, b""),
            Case("5000-digit integer", path, good[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}"),
            Case("1e999999 temperature", path, good[:-1] + b', "temperature": 1e999999}'),
            Case("NaN temperature literal", path, good[:-1] + b', "temperature": NaN}'),
            Case("10000-level nested array", path, nest),
            Case("10000-level nested messages", path, good[:-1] + b', "messages": ' + nest + b"}"),
            Case("top level not an object", path, rng.choice([b"[]", b'"x"', b"1", b"null", b"true"])),
            Case("random bytes", path, rng.randbytes(rng.randrange(1, 4096))),
            Case("wrong Content-Type", path, good, content_type=rng.choice(["text/plain", "multipart/form-data",
                                                                             "application/x-www-form-urlencoded"])),
            Case("wrong method", path, good, method=rng.choice(["GET", "PUT", "DELETE", "PATCH"])),
            Case("unknown path", path + rng.choice(["/x", "s", "/../../etc/passwd"]), good),
            Case("2 MiB body (limit 1 MiB)", path, good[:-1] + b', "pad": "' + b"x" * 2**21 + b'"}')]


def make_cases(n: int, seed: int, routes: list[str] | None = None) -> list[Case]:
    """Deterministic: first every raw and out-of-range case per route (of `routes`,
    default all), then random wrong-typed fields, until n."""
    rng = random.Random(seed)
    routes = routes or ROUTES
    special = [c for p in routes for c in raw_cases(p, rng)]
    for field, value in OUT_OF_RANGE:
        fits = [p for p in routes if field.split(".")[0] in FIELDS[p] or field in FIELDS[p]]
        if not fits:
            continue
        path = rng.choice(fits)
        special.append(Case(f"{field}={repr(value)[:40]}", path, dumps(put(base_body(path), field, value))))
    rng.shuffle(special)
    cases = special[:n]
    while len(cases) < n:
        path = rng.choice(routes)
        field, value = rng.choice(FIELDS[path]), rng.choice(WRONG)
        cases.append(Case(f"{field}={repr(value)[:40]}", path, dumps(put(base_body(path), field, value))))
    return cases

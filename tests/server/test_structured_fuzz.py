"""Structured output under fuzzing: seeded random JSON schemas, grammars, regexes and
Responses bodies (random nesting and types, huge enums, deep nesting, contradictory
bounds, dangling and recursive $refs, catastrophic regexes such as `(a+)+$`, formats
nobody enforces, invalid JSON) sent to every structured-output field of every API
against the real SmolLM2, a few tokens each. No case may answer 5xx or drop the
connection, and /health, probed from another thread throughout, must answer within
50 ms (99th percentile; the slowest within a second). 50 cases by default; `--long`
adds the full 1,000 in ten tests."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time

import pytest

from tests.helpers.serve_process import ServeProcess
from tests.helpers.server_harness import health_latency, request

HEALTH_LIMIT_S = 0.050  # /health's 99th percentile
STALL_LIMIT_S = 1.0  # and its slowest
MAX_TOKENS = 4
CATASTROPHIC = ["(a+)+$", "(a|a)*b", "(a|aa)+$", "(.*a){12}", "^(\\w+\\s?)*$", "(x+x+)+y", "([a-zA-Z]+)*[0-9]",
                "(a*)*b", "^(a?){25}a{25}$", "(\\d+)*\\.\\d{2}$"]
ODD_PATTERNS = ["[", "(?=a)b", "(?<!x)y", "\\", "a{5,2}", "\\p{Greek}+", "[^\\x00-\\x7f]{3}", "(?i)abc", "\\bword\\b",
                "^$", ".{100000}", "[\\u0000-\\uffff]*", "a{0,65535}", "(((((((((a)))))))))", "\ud83d\ude00+"]
FORMATS = ["date", "date-time", "time", "duration", "email", "uuid", "ipv4", "ipv6", "hostname", "uri",
           "uri-reference", "iri", "binary", "color", "", "DATE"]
WEIRD_TYPES = ["foo", 5, None, [], ["string", "banana"], {"type": "string"}, True, "any"]


def random_schema(rng: random.Random, depth: int = 0):
    """A random JSON Schema: valid, odd or broken."""
    if depth > 4 or rng.random() < 0.2:
        return rng.choice([_string(rng), _number(rng), {"type": "boolean"}, {"type": "null"}, True, False, {},
                           {"type": rng.choice(WEIRD_TYPES)}, {"const": rng.choice([1, "x", None, [1], {"a": 2}])}])
    kind = rng.choice(["object", "object", "array", "enum", "anyOf", "oneOf", "allOf", "ref", "types", "not",
                       "ifthen"])
    sub = lambda: random_schema(rng, depth + 1)  # noqa: E731
    if kind == "object":
        props = {_key(rng): sub() for _ in range(rng.randint(0, 6))}
        out = {"type": "object", "properties": props,
               "required": rng.sample(list(props), rng.randint(0, len(props))) + (["ghost"] if rng.random() < 0.1 else [])}
        if rng.random() < 0.4:
            out["additionalProperties"] = rng.choice([False, True, sub()])
        if rng.random() < 0.15:
            out.update(minProperties=rng.randint(0, 9), maxProperties=rng.randint(0, 9))
        return out
    if kind == "array":
        lo, hi = rng.randint(0, 5), rng.choice([0, 1, 3, 10, 10**6])
        return {"type": "array", "items": sub(), "minItems": lo if rng.random() < 0.9 else 10**9, "maxItems": hi,
                **({"prefixItems": [sub(), sub()]} if rng.random() < 0.2 else {}),
                **({"uniqueItems": True} if rng.random() < 0.1 else {})}
    if kind == "enum":
        n = rng.choice([1, 3, 50, 1000, 4000])
        return {"enum": [rng.choice([f"value-{i}-{rng.random():.6f}", i, i * 0.5, None, [i], {"k": i}])
                         for i in range(n)]}
    if kind in ("anyOf", "oneOf", "allOf"):
        return {kind: [sub() for _ in range(rng.randint(0, 4))]}
    if kind == "ref":
        return {"$defs": {"a": sub(), "loop": {"$ref": "#/$defs/loop"}, "tree": {
                    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}},
                "$ref": rng.choice(["#/$defs/a", "#/$defs/loop", "#/$defs/tree", "#/$defs/missing", "#/nowhere",
                                    "http://example.com/schema.json", "#"])}
    if kind == "types":
        return {"type": rng.sample(["string", "number", "integer", "object", "array", "null", "boolean"],
                                   rng.randint(1, 4))}
    if kind == "not":
        return {"not": sub()}
    return {"if": sub(), "then": sub(), "else": sub()}


def _key(rng: random.Random) -> str:
    return rng.choice(["name", "id", "a b", "", "ключ", "😀", "$ref", "__proto__", "x" * rng.choice([1, 300]),
                       f"k{rng.randint(0, 99)}", "\"quoted\"", "new\nline"])


def _string(rng: random.Random) -> dict:
    out: dict = {"type": "string"}
    if rng.random() < 0.5:
        out["pattern"] = rng.choice(CATASTROPHIC + ODD_PATTERNS + ["^[a-z]{3}$", "^\\d{4}-\\d{2}$"])
    if rng.random() < 0.3:
        out["format"] = rng.choice(FORMATS)
    if rng.random() < 0.3:
        out.update(minLength=rng.choice([0, 5, 10**9]), maxLength=rng.choice([0, 3, 10**9, -1]))
    return out


def _number(rng: random.Random) -> dict:
    out: dict = {"type": rng.choice(["number", "integer"])}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if rng.random() < 0.3:
            out[key] = rng.choice([0, -1, 1e308, -1e308, 0.1, 1e-9, 7, "ten", None])
    return out


def deep(depth: int, rng: random.Random) -> str:
    """A schema nested `depth` objects (or arrays) deep, as JSON text."""
    if rng.random() < 0.5:
        return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def _schema_text(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.08:
        return deep(rng.choice([20, 200, 2000, 20000]), rng)
    if roll < 0.14:  # broken JSON where a schema goes
        return rng.choice(['{"type": "object",', "{'type': 'object'}", '{"type": "string"} trailing', "[1, 2",
                           '"just a string"', "NaN", "{" * 5000])
    return json.dumps(random_schema(rng))


def fuzz_case(rng: random.Random) -> tuple[str, str]:
    """One (path, body text): a random constraint in a random field of a random API."""
    text = _schema_text(rng)
    msgs = '[{"role": "user", "content": "Give me JSON."}]'
    fmt = rng.choice([f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {text}}}}}',
                      f'{{"type": "json_schema", "json_schema": {{"name": "x", "strict": true, "schema": {text}}}}}',
                      '{"type": "json_object"}', '{"type": "json_schema"}', '{"type": "xml"}', text, '"json"'])
    tools = f'[{{"type": "function", "function": {{"name": "f", "parameters": {text}}}}}]'
    regex = json.dumps(rng.choice(CATASTROPHIC + ODD_PATTERNS))
    grammar = json.dumps(rng.choice(['root ::= "a"+', 'root ::= root', 'root ::= [', 'start: "x"*', "", "x" * 5000,
                                     'root ::= ("a" | "b")* "c"', 'root ::= item{1000000}']))
    n = MAX_TOKENS
    openai_choice = rng.choice(['"required"', '"auto"', '{"type": "function", "function": {"name": "f"}}'])
    responses_choice = rng.choice(['"required"', '"auto"', '{"type": "function", "name": "f"}'])
    stream = rng.choice(["true", "false"])
    responses_input = rng.choice([text, "[]", "null", "[{}]"])
    responses_text = rng.choice([text, "{}", '{"format": null}'])
    bodies = [
        ("/v1/chat/completions", f'{{"messages": {msgs}, "max_tokens": {n}, "response_format": {fmt}}}'),
        ("/v1/chat/completions", f'{{"messages": {msgs}, "max_tokens": {n}, "tools": {tools}, "tool_choice": '
                                 f'{openai_choice}}}'),
        ("/v1/completions", f'{{"prompt": "JSON:", "max_tokens": {n}, "response_format": {fmt}}}'),
        ("/v1/completions", f'{{"prompt": "x", "max_tokens": {n}, "regex": {regex}}}'),
        ("/v1/completions", f'{{"prompt": "x", "max_tokens": {n}, "grammar": {grammar}}}'),
        ("/v1/chat/completions", f'{{"messages": {msgs}, "max_tokens": {n}, "structured_outputs": '
                                 f'{{"choice": {json.dumps(["a", "b", "(a+)+"][: rng.randint(0, 3)])}}}}}'),
        ("/v1/chat/completions", f'{{"messages": {msgs}, "max_tokens": {n}, "guided_json": {text}, "guided_regex": {regex}}}'),
        ("/api/chat", f'{{"messages": {msgs}, "stream": false, "format": {text}, "options": {{"num_predict": {n}}}}}'),
        ("/api/generate", f'{{"prompt": "JSON:", "stream": {stream}, "format": {text}, '
                          f'"options": {{"num_predict": {n}}}}}'),
        ("/v1/messages", f'{{"model": "claude", "max_tokens": {n}, "messages": {msgs}, "output_config": '
                         f'{{"format": {{"type": "json_schema", "schema": {text}}}}}}}'),
        ("/v1/messages", f'{{"model": "claude", "max_tokens": {n}, "messages": {msgs}, "tools": [{{"name": "f", '
                         f'"input_schema": {text}}}], "tool_choice": {{"type": "{rng.choice(["any", "tool", "auto"])}", "name": "f"}}}}'),
        ("/v1/responses", f'{{"input": "Give me JSON.", "max_output_tokens": {n}, "text": {{"format": '
                          f'{{"type": "json_schema", "name": "x", "schema": {text}}}}}}}'),
        ("/v1/responses", f'{{"input": [{{"role": "user", "content": "hi"}}], "max_output_tokens": {n}, "tools": '
                          f'[{{"type": "function", "name": "f", "parameters": {text}}}], "tool_choice": '
                          f'{responses_choice}, "stream": {stream}}}'),
        ("/v1/responses", f'{{"input": {responses_input}, "max_output_tokens": {n}, "text": {responses_text}}}'),
    ]
    path, body = rng.choice(bodies)
    if rng.random() < 0.05:  # truncated mid-body
        body = body[: rng.randint(0, len(body))]
    return path, body


class HealthProbe:
    """GET /health on a new connection every few milliseconds from its own thread, each latency kept."""

    def __init__(self, port: int):
        self.port, self.latencies, self.failures = port, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while not self._stop.is_set():
                try:
                    self.latencies.append(loop.run_until_complete(health_latency(self.port)))
                except (OSError, AssertionError) as e:
                    self.failures.append(repr(e))
                self._stop.wait(0.02)
        finally:
            loop.close()


class Served:
    """`justfit serve` in its own process (what /health measures is the server alone,
    not this process's client threads), where `request` and `health_latency` reach it."""

    def __init__(self, state_dir):
        self.process = ServeProcess("smollm2", state_dir)
        self.url = self.process.url
        self.port = int(self.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("fuzz-state"))
    # The first constrained request builds the engine's grammar tokenizer, once, before
    # the probing starts: its cost is the engine's load, not a request's
    status, _, text = request(served, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "regex": "a"})
    assert status == 200, text
    yield served
    served.process.kill()


def fuzz(live, seed: int, count: int) -> dict:
    """`count` cases from `seed` against `live` with /health probed throughout: what came back."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    errors, slow = [], []
    with HealthProbe(live.port) as probe:
        for i in range(count):
            path, body = fuzz_case(rng)
            start = time.perf_counter()
            try:
                status, _, text = request(live, "POST", path, raw=body.encode("utf-8", "surrogatepass"),
                                          headers={"Content-Type": "application/json"})
            except Exception as e:  # a dropped connection or a timeout: a failure, reported with its case
                errors.append(f"case {i} {path}: {e!r}: {body[:200]}")
                continue
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500:
                errors.append(f"case {i} {path}: {status} {text[:200]}: {body[:200]}")
            if time.perf_counter() - start > 10:
                slow.append(f"case {i} {path}: {time.perf_counter() - start:.1f} s")
    lat = sorted(probe.latencies)
    return {"statuses": statuses, "errors": errors, "slow": slow, "health_failures": probe.failures,
            "health_probes": len(lat), "health_max_s": lat[-1] if lat else None,
            "health_median_s": statistics.median(lat) if lat else None,
            "health_p99_s": lat[len(lat) * 99 // 100] if lat else None}


def _assert_clean(got: dict) -> None:
    assert not got["errors"], got["errors"][:5]
    assert not got["health_failures"], got["health_failures"][:5]
    # p99, not the maximum: on a loaded shared machine the scheduler alone delays a probe
    # past 50 ms now and then (docs/SERVING.md has the full run's maxima); a stall of the
    # server's own (a compile or a tokenizer build holding the GIL) shows as a second's
    assert got["health_probes"] > 10 and got["health_p99_s"] < HEALTH_LIMIT_S, got
    assert got["health_max_s"] < STALL_LIMIT_S, got
    assert 200 in got["statuses"] and 400 in got["statuses"], got["statuses"]  # both kinds were exercised


def test_structured_fuzz_short(live):
    """50 fuzzed constraints: no 5xx, /health under 50 ms."""
    _assert_clean(fuzz(live, seed=1, count=50))


@pytest.mark.parametrize("part", range(10))
def test_structured_fuzz_full(request, live, part):
    """1,000 fuzzed constraints in ten parts of 100 (--long)."""
    if not request.config.getoption("--long"):
        pytest.skip("the full fuzz runs with --long")
    _assert_clean(fuzz(live, seed=1000 + part, count=100))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_tool_parameters_nested_deeply_are_a_400(live, path):
    """A forced tool call whose parameters nest 200 objects deep (under the body's own
    nesting limit) is refused as too deep, never a 500 from the schema walks' recursion."""
    schema = '{"type":"object","properties":{"a":' * 200 + '{"type":"string"}' + "}}" * 200
    msgs = '[{"role": "user", "content": "hi"}]'
    body = (f'{{"model": "claude", "max_tokens": 4, "messages": {msgs}, "tools": [{{"name": "f", "input_schema": '
            f'{schema}}}], "tool_choice": {{"type": "any"}}}}' if path == "/v1/messages" else
            f'{{"max_tokens": 4, "messages": {msgs}, "tools": [{{"type": "function", "function": {{"name": "f", '
            f'"parameters": {schema}}}}}], "tool_choice": "required"}}')
    status, _, text = request(live, "POST", path, raw=body.encode())
    assert status == 400 and "nested too deeply" in text, (status, text[:300])

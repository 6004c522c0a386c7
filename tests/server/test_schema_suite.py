"""Structured output end to end: the suite's JSON schemas (structured_schemas.py), each
asked for with its prompt through the real clients and routes of `justfit serve`, on the
real SmolLM2 (chat routes) and Gemma 3 (raw completions). Every reply must parse and
validate against its schema, formats included; a reply cut by the token limit fails.

The default run sends a few schemas greedily: 8 through the OpenAI client on chat, 2
through Ollama's /api/chat, 2 through the Anthropic client, 2 on /v1/completions with
Gemma 3. `--long` runs the full variant: every schema through OpenAI, Ollama and
Anthropic on SmolLM2 and through /v1/completions and /api/generate on Gemma 3, greedy
and at temperature 0.8, 400 tokens at most, one test per schema; its tally is saved as
a result file (schema-suite-TIME.json, where the benchmarks save theirs)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest

from justfit import Engine
from tests.helpers.server_harness import LiveServer, request
from tests.server.structured_schemas import SHORT, UNENFORCED_FORMATS, cases, check

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("jsonschema")

CASES = {c.name: c for c in cases()}
MAX_TOKENS = 400
SEED = 7


@dataclass(frozen=True)
class Reply:
    """A reply's text and whether it ended on its own (not on the token limit)."""

    text: str
    ended: bool


def openai_chat(live, case, temperature: float, max_tokens: int = MAX_TOKENS) -> Reply:
    """The case through the OpenAI client's chat completions, response_format json_schema."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": case.prompt}], max_tokens=max_tokens,
        temperature=temperature, seed=SEED,
        response_format={"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}})
    return Reply(r.choices[0].message.content, r.choices[0].finish_reason == "stop")


def openai_completion(live, case, temperature: float, max_tokens: int = MAX_TOKENS) -> Reply:
    """The case as a raw prompt through the OpenAI client's completions, response_format json_schema."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(
        model="default", prompt=f"{case.prompt}\nJSON:", max_tokens=max_tokens, temperature=temperature, seed=SEED,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": case.name,
                                                                               "schema": case.schema}}})
    return Reply(r.choices[0].text, r.choices[0].finish_reason == "stop")


def _ollama(live, path: str, body: dict, temperature: float, max_tokens: int) -> dict:
    body = {**body, "stream": False, "options": {"temperature": temperature, "num_predict": max_tokens, "seed": SEED}}
    status, _, text = request(live, "POST", path, body)
    assert status == 200, text
    return json.loads(text)


def ollama_chat(live, case, temperature: float, max_tokens: int = MAX_TOKENS) -> Reply:
    """The case through Ollama's /api/chat, `format` the schema."""
    got = _ollama(live, "/api/chat", {"model": "default", "format": case.schema,
                                      "messages": [{"role": "user", "content": case.prompt}]}, temperature, max_tokens)
    return Reply(got["message"]["content"], got.get("done_reason") == "stop")


def ollama_generate(live, case, temperature: float, max_tokens: int = MAX_TOKENS) -> Reply:
    """The case through Ollama's /api/generate (raw prompt), `format` the schema."""
    got = _ollama(live, "/api/generate", {"model": "default", "format": case.schema, "raw": True,
                                          "prompt": f"{case.prompt}\nJSON:"}, temperature, max_tokens)
    return Reply(got["response"], got.get("done_reason") == "stop")


def anthropic_messages(live, case, temperature: float, max_tokens: int = MAX_TOKENS) -> Reply:
    """The case through the Anthropic client's messages, output_config.format json_schema."""
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
    r = client.messages.create(
        model="claude-sonnet", max_tokens=max_tokens, messages=[{"role": "user", "content": case.prompt}],
        extra_body={"temperature": temperature, "seed": SEED,  # the package sends sampling only this way
                    "output_config": {"format": {"type": "json_schema", "schema": case.schema}}})
    return Reply("".join(b.text for b in r.content if b.type == "text"), r.stop_reason == "end_turn")


SMOLLM2_ROUTES = {"openai": openai_chat, "ollama": ollama_chat, "anthropic": anthropic_messages}
GEMMA3_ROUTES = {"completions": openai_completion, "generate": ollama_generate}


def failure(reply: Reply, case) -> str | None:
    """Why a reply fails the suite, or None: cut by the limit, not JSON, or invalid."""
    if not reply.ended:
        return f"ended by the token limit: {reply.text[-80:]!r}"
    return check(case.schema, reply.text)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    live = LiveServer(Engine(str(smollm2_gguf)))
    yield live
    live.close()


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    live = LiveServer(Engine(str(gemma3_gguf)))
    yield live
    live.close()


def _run(sends: list[tuple[str, object, object, str, float]]) -> list[str]:
    """Each (route name, send, live, case name, temperature) sent; the failures, described."""
    out = []
    for route, send, live, name, temperature in sends:
        why = failure(send(live, CASES[name], temperature), CASES[name])
        if why:
            out.append(f"{name} via {route} at t={temperature}: {why}")
    return out


def test_schema_suite_short_on_smollm2(smollm2):
    """8 schemas greedily through the OpenAI client, 2 through Ollama, 2 through Anthropic:
    every reply ends on its own and validates."""
    sends = [("openai", openai_chat, smollm2, name, 0.0) for name in SHORT]
    sends += [("ollama", ollama_chat, smollm2, name, 0.0) for name in ("weather", "invoice")]
    sends += [("anthropic", anthropic_messages, smollm2, name, 0.0) for name in ("todo", "account")]
    assert _run(sends) == []


def test_schema_suite_short_on_gemma3_completions(gemma3):
    """2 schemas greedily on /v1/completions with Gemma 3 (a raw prompt, no chat template)."""
    assert _run([("completions", openai_completion, gemma3, name, 0.0) for name in ("book", "recipe_steps")]) == []


@pytest.mark.parametrize("fmt", UNENFORCED_FORMATS)
def test_a_format_llguidance_does_not_enforce_is_refused(smollm2, fmt):
    """A schema naming a string format the engine cannot enforce is a 400 naming it
    (code invalid_grammar where the API has codes) on every API, before any work: never
    a reply that ignores it."""
    schema = {"type": "object", "properties": {"x": {"type": "string", "format": fmt}}, "required": ["x"]}
    bodies = {
        "/v1/chat/completions": {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                                 "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                            "schema": schema}}},
        "/api/chat": {"model": "default", "stream": False, "format": schema, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/messages": {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                         "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    }
    for path, body in bodies.items():
        status, _, text = request(smollm2, "POST", path, body)
        assert status == 400, (path, status, text)
        assert fmt in text, (path, text)
        if path == "/v1/chat/completions":  # the one API of the three whose errors carry a code
            assert json.loads(text)["error"]["code"] == "invalid_grammar", text


# -- the full variant (--long) ---------------------------------------------------------
@pytest.fixture(scope="module")
def tally():
    """Each full-variant reply's outcome; the result file, rewritten after each schema
    (a run stopped part way keeps what it measured)."""
    rows: list[dict] = []
    started = time.strftime("%Y%m%d-%H%M%S")
    yield rows, started


def _save_tally(rows: list[dict], started: str) -> None:
    from bench.common import RESULTS, machine_info

    combos: dict[str, dict] = {}
    for r in rows:
        c = combos.setdefault(f"{r['model']} {r['route']} t={r['temperature']}", {"sent": 0, "passed": 0,
                                                                                  "length": 0, "invalid": 0})
        c["sent"] += 1
        c["passed"] += r["failure"] is None
        c["length"] += bool(r["failure"] and r["failure"].startswith("ended by the token limit"))
        c["invalid"] += bool(r["failure"] and not r["failure"].startswith("ended by the token limit"))
    failures = [{k: r[k] for k in ("schema", "model", "route", "temperature", "failure")} for r in rows if r["failure"]]
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "command": "python -m pytest tests/server/test_schema_suite.py --long -k full",
              "settings": {"schemas": len(CASES), "max_tokens": MAX_TOKENS, "seed": SEED, "temperatures": "0, 0.8"},
              "sent": len(rows), "passed": sum(r["failure"] is None for r in rows),
              "seconds": round(sum(r["seconds"] for r in rows), 1), "schemas_done": len({r["schema"] for r in rows}),
              "combos": combos, "failures": failures}
    (RESULTS / f"schema-suite-{started}.json").write_text(json.dumps(result, indent=1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_schema_suite_full(request, smollm2, gemma3, tally, name):
    """One schema through every API on its model, greedy and at t=0.8 (--long)."""
    if not request.config.getoption("--long"):
        pytest.skip("the full schema suite runs with --long")
    rows, started = tally
    failures = []
    for model, live, routes in (("smollm2", smollm2, SMOLLM2_ROUTES), ("gemma3", gemma3, GEMMA3_ROUTES)):
        for route, send in routes.items():
            for temperature in (0.0, 0.8):
                start = time.perf_counter()
                try:
                    why = failure(send(live, CASES[name], temperature), CASES[name])
                except Exception as e:  # a timeout or an error status: a failure of this reply, recorded
                    why = f"error: {e!r}"
                why = why and why[:160]
                rows.append({"schema": name, "model": model, "route": route, "temperature": temperature,
                              "failure": why, "seconds": time.perf_counter() - start})
                if why:
                    failures.append(f"{model} {route} t={temperature}: {why}")
    _save_tally(rows, started)
    assert failures == []

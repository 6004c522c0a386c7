"""Speculative decoding with prompt-lookup drafts (justfit.engine.draft), over HTTP: JustFit
with drafts on and off, and llama-server without and with its own n-gram speculation,
on the same GGUF and the same greedy requests.

    python -m bench.speculation --model smollm2 --llama-cpp /path/to/llama.cpp/build/bin

Workloads (OpenAI-compatible /v1/chat/completions, temperature 0, streamed; with
`--text`, and always for the base model gemma3, each conversation as plain text
"User: ...\n\nAssistant:" to /v1/completions, stopped at the next "User:"):

- code-edit: a 40-80 line function from the running Python's standard library
  (textwrap, shlex) shown in the prompt, to be repeated exactly or repeated with one
  identifier renamed: replies that copy their context, where drafts should pay;
- prose: a story from a one-line prompt: little to copy, where drafts should cost nothing;
- chat: short questions a chat assistant answers (explanations, advice, lists): replies
  with little to copy, where drafts should cost nothing either;
- agent: bench/data/agent_trajectory.json, 15+ turns (files shown, tool outputs to quote,
  edits, short questions) appended to one growing conversation with the system's own
  replies, so prompt caching matters; its total completion time is reported.
- agent-tools / agent-responses (JustFit only): the same trajectory with a function tool
  offered, over /v1/chat/completions (the whole conversation each turn) and over the
  Responses API (/v1/responses, each turn only its new message and the previous
  response's id, the server continuing its stored state). Their rows carry each turn's
  cached tokens as a share of the previous turn's context (`cached_share_min`), and
  agent-responses its total time over agent-tools' (`responses_over_chat`).

On SmolLM2 (SmolLM2-135M-Instruct) every workload goes through the chat template; gemma3
is a base model, so its rows measure a model continuing its own plain text, not chat.

`--rounds N` (JustFit only): one server, each workload run N times with drafts on and
off per request (`"speculate"`), the order alternating round by round (on first, then
off first), so load on a shared machine falls on both alike; each workload's rows carry
every round's drafts-on / drafts-off ratio of decode tokens per second (and of total
time), their median and spread (min, max):

    python -m bench.speculation --model smollm2 --rounds 3 --max-tokens 128 --turns 6

With `--in-process` the same alternation runs in this process's engine (no server, no
HTTP) and each reply's decode is timed in process CPU seconds from its first token to its
last: on a machine shared with other jobs CPU time moves far less with their load than
wall time does.

Otherwise each system runs every workload in its own server, one server at a time. A row per
system and workload: wall time, completion tokens, decode tokens per second (tokens after
the first over the time after the first arrived), drafted and accepted tokens where the
server reports them (JustFit's `usage.drafted_tokens` / `accepted_tokens`, llama-server's
`timings.draft_n` / `draft_n_accepted`; None where absent), and whether each reply's text
equals the same server's reply with drafts off (greedy: it must).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import inspect
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TRAJECTORY = Path(__file__).resolve().parent / "data" / "agent_trajectory.json"
LLAMA_CPP = "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
# llama-server's n-gram speculation: look up the last 3 tokens, draft up to 16 (its
# default lookup of 12 tokens rarely matches in short replies)
LLAMA_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16 --spec-draft-n-max 16"
SYSTEMS = ("justfit", "justfit-nodraft", "llama-server", "llama-server-ngram")
WORKLOADS = ("code-edit", "prose", "chat", "agent", "agent-tools", "agent-responses")
RESPONSES_ONLY = ("agent-tools", "agent-responses")  # JustFit's (llama-server has no /v1/responses)
# The function tool the tool-bearing agent workloads offer (chat completions' form; flat on /v1/responses).
AGENT_TOOL = {"type": "function", "function": {
    "name": "run_command", "description": "Run a shell command in the repository and return what it printed.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
# the drafts-off twin each system's replies are checked against
TWIN = {"justfit": "justfit-nodraft", "llama-server-ngram": "llama-server"}

# Standard-library functions shown for editing, and an identifier each renames.
CODE = [(textwrap.TextWrapper, "_wrap_chunks", "chunks", "pieces"),
        (textwrap, "dedent", "margin", "indent_prefix"),
        (shlex.shlex, "read_token", "nextchar", "next_char"),
        (textwrap.TextWrapper, "_handle_long_word", "space_left", "room_left"),
        (shlex, "split", "lex", "lexer"),
        (textwrap, "indent", "predicate", "should_indent")]
PROSE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Write a short story about a robot learning to bake bread.",
         "Describe a walk through a city market early on a winter morning.",
         "Write a letter from a traveller to a friend about a journey across the mountains."]
CHAT = ["What are some good ways to get better sleep?",
        "Explain how vaccines train the immune system, in simple terms.",
        "I have a job interview tomorrow. How should I prepare?",
        "What is the difference between weather and climate?"]


@dataclass
class Reply:
    """One request's outcome."""

    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    total_s: float = 0.0
    first_s: float | None = None  # time to the first text
    drafted: int | None = None
    accepted: int | None = None
    error: str | None = None
    response_id: str | None = None  # the Responses API's id of this reply

    @property
    def decode_s(self) -> float:
        return self.total_s - (self.first_s if self.first_s is not None else self.total_s)


def function_source(owner, name: str, max_lines: int = 80) -> str:
    """A function's source, dedented, cut to `max_lines` lines."""
    lines = textwrap.dedent(inspect.getsource(getattr(owner, name))).splitlines()
    return "\n".join(lines[:max_lines]) + "\n"


def code_requests(count: int) -> list[list[dict]]:
    """`count` code-edit conversations: repeat a function, or repeat it with a rename."""
    out = []
    for i in range(count):
        owner, name, old, new = CODE[(i // 2) % len(CODE)]
        code = function_source(owner, name)
        ask = ("Repeat this Python function exactly, as code only." if i % 2 == 0 else
               f"Rewrite this Python function with the identifier `{old}` renamed to `{new}` everywhere. "
               "Reply with the whole function, as code only.")
        out.append([{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}])
    return out


def turn_message(turn: dict) -> str:
    """One recorded agent turn as the user's message."""
    kind = turn["kind"]
    if kind == "file":
        return f"Here is {turn['path']}:\n```\n{turn['content']}```\n{turn['ask']}"
    if kind == "tool":
        return f"`{turn['command']}` printed:\n```\n{turn['output']}```\n{turn['ask']}"
    if kind == "edit":
        return f"Edit {turn['path']}: {turn['instruction']}. {turn['ask']}"
    return turn["text"]


def load_trajectory(path: Path = TRAJECTORY) -> tuple[str, list[str]]:
    data = json.loads(path.read_text())
    return data["system"], [turn_message(t) for t in data["turns"]]


def sse_events(raw: bytes):
    """The JSON payloads of a server-sent-events body's `data:` lines."""
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload and payload != "[DONE]":
                with contextlib.suppress(json.JSONDecodeError):
                    yield json.loads(payload)


def as_text(messages: list[dict]) -> str:
    """A conversation as one plain text for a base model (no chat template), ending where
    the assistant's next reply begins."""
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    return "".join(f"{names[m['role']]}: {m['content']}\n\n" for m in messages) + "Assistant:"


async def chat(http, url: str, messages: list[dict], max_tokens: int, speculate: bool | None,
               timeout: float, extra: dict | None = None, text: bool = False) -> Reply:
    """A streamed greedy chat completion, timed by its first text and its end; `extra`:
    more body fields; `text`: the conversation as plain text to /v1/completions, ended
    by the next "User:" (a base model)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": True}
    route = "/v1/chat/completions"
    if text:
        body = {**body, "prompt": as_text(body.pop("messages")), "stop": ["\nUser:"]}
        route = "/v1/completions"
    if speculate is not None:
        body["speculate"] = speculate
    body.update(extra or {})
    return await streamed(http, url + route, body, take, timeout)


async def streamed(http, url: str, body: dict, fold, timeout: float) -> Reply:
    """POST `body` to `url` and fold each event of its SSE stream into a timed Reply
    (`fold(event, reply, pieces, seconds)`)."""
    import aiohttp

    reply, pieces = Reply(), []
    start = time.perf_counter()
    try:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                reply.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return reply
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for event in sse_events(b"\n".join(lines)):
                    fold(event, reply, pieces, time.perf_counter() - start)
            for event in sse_events(buffer):
                fold(event, reply, pieces, time.perf_counter() - start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        reply.error = f"{type(e).__name__}: {e}"
    reply.total_s = time.perf_counter() - start
    reply.text = "".join(pieces)
    return reply


async def respond(http, url: str, instructions: str, user: str, previous: str | None, max_tokens: int,
                  speculate: bool | None, timeout: float) -> Reply:
    """One streamed greedy turn over the Responses API: `user`'s message after the
    response `previous` (the server holds the conversation), timed as `chat` times."""
    body = {"input": user, "instructions": instructions, "max_output_tokens": max_tokens, "temperature": 0,
            "stream": True, "tools": [{"type": "function", **AGENT_TOOL["function"]}]}
    if previous:
        body["previous_response_id"] = previous
    if speculate is not None:
        body["speculate"] = speculate
    return await streamed(http, url + "/v1/responses", body, take_response, timeout)


def take_response(event: dict, reply: Reply, pieces: list[str], at: float) -> None:
    """Fold one Responses stream event into `reply`."""
    kind = event.get("type", "")
    if kind == "response.output_text.delta" and event.get("delta"):
        reply.first_s = at if reply.first_s is None else reply.first_s
        pieces.append(event["delta"])
    elif kind in ("response.completed", "response.incomplete"):
        response = event["response"]
        usage = response.get("usage") or {}
        reply.response_id = response.get("id")
        reply.completion_tokens, reply.prompt_tokens = usage.get("output_tokens"), usage.get("input_tokens")
        reply.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        reply.drafted, reply.accepted = usage.get("drafted_tokens"), usage.get("accepted_tokens")
    elif kind in ("error", "response.failed"):
        reply.error = json.dumps(event)[:300]


def take(event: dict, reply: Reply, pieces: list[str], at: float) -> None:
    """Fold one streamed event into `reply`."""
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if text:
            if reply.first_s is None:
                reply.first_s = at
            pieces.append(text)
    usage = event.get("usage")
    if usage:
        reply.completion_tokens = usage.get("completion_tokens")
        reply.prompt_tokens = usage.get("prompt_tokens")
        reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if "drafted_tokens" in usage:
            reply.drafted, reply.accepted = usage["drafted_tokens"], usage.get("accepted_tokens")
    timings = event.get("timings")
    if timings:
        if "draft_n" in timings:
            reply.drafted, reply.accepted = timings["draft_n"], timings.get("draft_n_accepted")
        if reply.completion_tokens is None and "predicted_n" in timings:
            reply.completion_tokens = timings["predicted_n"]
        if reply.cached_tokens is None and "cache_n" in timings:
            reply.cached_tokens = timings["cache_n"]


@dataclass
class System:
    """How to start one server of the comparison."""

    name: str
    model: str
    llama_cpp: str = LLAMA_CPP
    llama_spec: str = LLAMA_SPEC
    context: int = 8192
    unavailable: str | None = None  # why it cannot run (the row says so)
    speculate: bool | None = None  # the per-request field JustFit takes

    def command(self, port: int) -> list[str]:
        if self.name.startswith("justfit"):
            cmd = [str(Path(sys.executable).parent / "justfit"), "serve", "--port", str(port), "--model", self.model]
            if justfit_drafts():
                cmd += ["--draft", "none" if self.name == "justfit-nodraft" else "ngram"]
            return cmd
        from bench.llamacpp import _gguf, binary

        cmd = [binary(self.llama_cpp, "llama-server"), "-m", _gguf(self.model), "--port", str(port),
               "--host", "127.0.0.1", "-c", str(self.context), "-np", "1", "-t", str(os.cpu_count() or 1),
               "--cache-prompt"]
        return cmd + (shlex.split(self.llama_spec) if self.name == "llama-server-ngram" else [])


@functools.cache
def justfit_drafts() -> bool:
    """Whether this JustFit's `serve` takes --draft."""
    exe = Path(sys.executable).parent / "justfit"
    try:
        out = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "--draft" in out


def make_system(name: str, args) -> System:
    s = System(name, args.model, args.llama_cpp, args.llama_spec, args.context)
    if name.startswith("llama-server"):
        from bench.llamacpp import binary

        exe = binary(args.llama_cpp, "llama-server")
        if not Path(exe).is_file():
            s.unavailable = f"no llama-server at {exe}: pass --llama-cpp DIR"
    elif name == "justfit" and not justfit_drafts():
        s.unavailable = "this justfit serve has no --draft: drafts unavailable"
    if name.startswith("justfit") and justfit_drafts():
        s.speculate = name == "justfit"
    return s


@contextlib.asynccontextmanager
async def running(system: System):
    """The system's server on a free port, ready, stopped (SIGINT) on exit."""
    from bench.server_process import launched

    async with launched(system.command, "justfit-spec-bench-", ready_s=600, stop_s=60) as (url, _, _):
        yield url


async def run_workload(http, url: str, system: System, workload: str, args) -> list[Reply]:
    """Every request of `workload`, one after another."""
    text = args.text
    if workload == "code-edit":
        return [await chat(http, url, m, args.max_tokens or 400, system.speculate, args.timeout, text=text)
                for m in code_requests(args.prompts)]
    if workload in ("prose", "chat"):
        asks = PROSE if workload == "prose" else CHAT
        return [await chat(http, url, [{"role": "user", "content": p}], args.max_tokens or 300, system.speculate,
                           args.timeout, text=text) for p in asks[:max(1, min(args.prompts, len(asks)))]]
    prompt, turns = load_trajectory()
    messages = [{"role": "system", "content": prompt}]
    replies: list[Reply] = []
    extra = {"tools": [AGENT_TOOL]} if workload == "agent-tools" else None
    for user in turns[:args.turns or None]:
        if workload == "agent-responses":
            previous = replies[-1].response_id if replies else None
            reply = await respond(http, url, prompt, user, previous, args.max_tokens or 200, system.speculate,
                                  args.timeout)
        else:
            messages.append({"role": "user", "content": user})
            reply = await chat(http, url, messages, args.max_tokens or 200, system.speculate, args.timeout,
                               extra=extra, text=text)
            messages.append({"role": "assistant", "content": reply.text})
        replies.append(reply)
        if reply.error:
            break
    return replies


def _sum(values: list) -> int | None:
    return None if any(v is None for v in values) else sum(values)


def summarize(replies: list[Reply]) -> dict:
    """A workload's totals: times, tokens, decode rate, drafted and accepted tokens."""
    tokens = _sum([r.completion_tokens for r in replies])
    decode_s = sum(r.decode_s for r in replies)
    after_first = None if tokens is None else tokens - sum(1 for r in replies if r.first_s is not None)
    drafted, accepted = _sum([r.drafted for r in replies]), _sum([r.accepted for r in replies])
    return {"requests": len(replies), "total_s": round(sum(r.total_s for r in replies), 3),
            "first_s": round(sum(r.first_s or 0.0 for r in replies), 3), "decode_s": round(decode_s, 3),
            "completion_tokens": tokens,
            "decode_tps": round(after_first / decode_s, 2) if after_first and decode_s > 0 else None,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "cached_tokens": _sum([r.cached_tokens for r in replies]),
            "cached_share_min": cached_share_min(replies),
            "errors": [r.error for r in replies if r.error]}


def cached_share_min(replies: list[Reply]) -> float | None:
    """The least share, over a conversation's turns after the first, of the previous turn's
    context (its prompt and reply) that the turn found cached; None without the counts."""
    shares = [b.cached_tokens / (a.prompt_tokens + a.completion_tokens) for a, b in zip(replies, replies[1:])
              if None not in (a.prompt_tokens, a.completion_tokens, b.cached_tokens)
              and a.prompt_tokens + a.completion_tokens > 0]
    return round(min(shares), 4) if shares else None


def responses_over_chat(rows: list[dict]) -> None:
    """Mark each row's agent-responses workload with its total time over the same row's
    agent-tools (the same trajectory and tool over chat completions), and whether the
    replies were the same."""
    for row in rows:
        w = row.get("workloads", {})
        ours, theirs = w.get("agent-responses"), w.get("agent-tools")
        if not ours or not theirs or ours["errors"] or theirs["errors"] or not theirs["total_s"]:
            continue
        ours["responses_over_chat"] = round(ours["total_s"] / theirs["total_s"], 4)
        ours["same_replies_as_chat"] = [r["text_sha256"] for r in ours["replies"]] == [
            r["text_sha256"] for r in theirs["replies"]]


async def measure(system: System, args) -> dict:
    """One system's rows (one per workload), with each reply kept for the identity check."""
    import aiohttp

    row = {"system": system.name, "model": system.model}
    if system.name == "llama-server-ngram":
        row["llama_spec"] = system.llama_spec
    if system.unavailable:
        return {**row, "error": system.unavailable}
    row["load_before"] = round(os.getloadavg()[0], 2)
    workloads = {}
    try:
        # a fresh connection per request: llama-server closes one after a streamed reply
        async with running(system) as url, aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            for workload in args.workloads:
                if workload in RESPONSES_ONLY and not system.name.startswith("justfit"):
                    continue
                replies = await run_workload(http, url, system, workload, args)
                workloads[workload] = {**summarize(replies), "replies": [kept(r) for r in replies]}
                print(json.dumps({"system": system.name, "workload": workload,
                                  **{k: v for k, v in workloads[workload].items() if k != "replies"}}),
                      file=sys.stderr, flush=True)
    except (OSError, RuntimeError) as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    row["load_after"] = round(os.getloadavg()[0], 2)
    return {**row, "workloads": workloads}


async def alternate(system: System, args) -> dict:
    """JustFit's drafts on against off in one server (`--rounds`): each round runs every
    workload with drafts on and off per request, the order alternating by round; per
    workload, each round's ratios and their median and spread."""
    import aiohttp

    row = {"system": "justfit-alternating", "model": system.model, "rounds": args.rounds}
    if system.unavailable:
        return {**row, "error": system.unavailable}
    row["load_before"] = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, list[dict]] = {w: [] for w in args.workloads}
    async with running(system) as url, aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for r in range(args.rounds):
            for workload in args.workloads:
                pair = {}
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    system.speculate = on
                    replies = await run_workload(http, url, system, workload, args)
                    pair["on" if on else "off"] = {**summarize(replies), "replies": [kept(x) for x in replies],
                                                   "load": round(os.getloadavg()[0], 2)}
                pair["first"] = "on" if r % 2 == 0 else "off"
                on_, off_ = pair["on"], pair["off"]
                pair["identical"] = ([x["text_sha256"] for x in on_["replies"]]
                                     == [x["text_sha256"] for x in off_["replies"]])
                if on_["decode_tps"] and off_["decode_tps"]:
                    pair["decode_ratio"] = round(on_["decode_tps"] / off_["decode_tps"], 3)
                if on_["total_s"] > 0:
                    pair["time_ratio"] = round(off_["total_s"] / on_["total_s"], 3)
                runs[workload].append(pair)
                print(json.dumps({"round": r, "workload": workload, "decode_ratio": pair.get("decode_ratio"),
                                  "on_tps": on_["decode_tps"], "off_tps": off_["decode_tps"],
                                  "drafted": on_["drafted_tokens"], "accepted": on_["accepted_tokens"],
                                  "identical": pair["identical"], "load": on_["load"]}), file=sys.stderr, flush=True)
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    row["workloads"] = {w: {"rounds": pairs, **spread(pairs, "decode_ratio", "decode"), **spread(pairs, "time_ratio", "time"),
                            "identical_to_drafts_off": all(p["identical"] for p in pairs),
                            "acceptance": _acceptance(pairs)}
                        for w, pairs in runs.items()}
    return row


def requests_of(workload: str, args) -> tuple[list[list[dict]], bool]:
    """A workload's conversations, and whether each turn continues the last (agent)."""
    if workload == "code-edit":
        return code_requests(args.prompts), False
    if workload in ("prose", "chat"):
        asks = PROSE if workload == "prose" else CHAT
        return [[{"role": "user", "content": p}] for p in asks[:max(1, min(args.prompts, len(asks)))]], False
    prompt, turns = load_trajectory()
    return [[{"role": "system", "content": prompt}], *([{"role": "user", "content": u}] for u in
                                                        turns[:args.turns or None])], True


def in_process_run(engine, workload: str, args, speculate: bool) -> dict:
    """A workload's replies in `engine`, each decode timed in process CPU seconds."""
    from justfit import SamplingParams

    convs, growing = requests_of(workload, args)
    history = convs[0] if growing else []
    out = {"tokens": 0, "decode_cpu_s": 0.0, "decode_wall_s": 0.0, "drafted": 0, "accepted": 0, "texts": []}
    for conv in (convs[1:] if growing else convs):
        messages = history + conv if growing else conv
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens or 128, speculate=speculate)
        pieces, first, stats = [], None, None
        for chunk in engine.generate(messages, sp):
            if first is None and chunk.text:
                first = (time.process_time(), time.perf_counter())
            pieces.append(chunk.text or "")
            stats = chunk.stats or stats
        end = (time.process_time(), time.perf_counter())
        text = "".join(pieces)
        if growing:
            history = messages + [{"role": "assistant", "content": text}]
        out["texts"].append(hashlib.sha256(text.encode()).hexdigest())
        if first is not None and stats is not None:
            out["tokens"] += max(0, stats.generated_tokens - 1)
            out["decode_cpu_s"] += end[0] - first[0]
            out["decode_wall_s"] += end[1] - first[1]
            out["drafted"] += stats.drafted_tokens
            out["accepted"] += stats.accepted_tokens
    out["cpu_tps"] = round(out["tokens"] / out["decode_cpu_s"], 2) if out["decode_cpu_s"] > 0 else None
    out["wall_tps"] = round(out["tokens"] / out["decode_wall_s"], 2) if out["decode_wall_s"] > 0 else None
    return out


def alternate_in_process(args) -> dict:
    """`alternate` in this process's engine: drafts on and off per request, order
    alternating by round, decode timed in CPU seconds (see the module doc)."""
    from justfit import Engine
    from justfit.config import EngineConfig
    from justfit.model.models import resolve

    engine = Engine(str(resolve(args.model)), config=EngineConfig(draft="ngram"))
    row = {"system": "justfit-alternating-in-process", "model": args.model, "rounds": args.rounds,
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    runs: dict[str, list[dict]] = {w: [] for w in args.workloads}
    for r in range(args.rounds):
        for workload in args.workloads:
            pair = {"first": "on" if r % 2 == 0 else "off"}
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                pair["on" if on else "off"] = {**in_process_run(engine, workload, args, on),
                                               "load": round(os.getloadavg()[0], 2)}
            on_, off_ = pair["on"], pair["off"]
            pair["identical"] = on_["texts"] == off_["texts"]
            if on_["cpu_tps"] and off_["cpu_tps"]:
                pair["cpu_ratio"] = round(on_["cpu_tps"] / off_["cpu_tps"], 3)
            if on_["wall_tps"] and off_["wall_tps"]:
                pair["wall_ratio"] = round(on_["wall_tps"] / off_["wall_tps"], 3)
            runs[workload].append(pair)
            print(json.dumps({"round": r, "workload": workload, "cpu_ratio": pair.get("cpu_ratio"),
                              "wall_ratio": pair.get("wall_ratio"), "on_cpu_tps": on_["cpu_tps"],
                              "off_cpu_tps": off_["cpu_tps"], "drafted": on_["drafted"], "accepted": on_["accepted"],
                              "identical": pair["identical"], "load": on_["load"]}), file=sys.stderr, flush=True)
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    row["workloads"] = {w: {"rounds": pairs, **spread(pairs, "cpu_ratio", "decode"), **spread(pairs, "wall_ratio", "wall"),
                            "identical_to_drafts_off": all(p["identical"] for p in pairs),
                            "acceptance": round(sum(p["on"]["accepted"] for p in pairs)
                                                / max(1, sum(p["on"]["drafted"] for p in pairs)), 3)}
                        for w, pairs in runs.items()}
    return row


def spread(pairs: list[dict], key: str, name: str) -> dict:
    """The median, min and max of `key` over the rounds (as `{name}_median` etc.)."""
    values = sorted(p[key] for p in pairs if key in p)
    if not values:
        return {}
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return {f"{name}_median": round(median, 3), f"{name}_min": values[0], f"{name}_max": values[-1]}


def _acceptance(pairs: list[dict]) -> float | None:
    drafted = sum(p["on"]["drafted_tokens"] or 0 for p in pairs)
    accepted = sum(p["on"]["accepted_tokens"] or 0 for p in pairs)
    return round(accepted / drafted, 3) if drafted else None


def kept(reply: Reply) -> dict:
    """What a result file keeps of a reply: its figures, and its text as a digest (the
    identity check compares digests) with its first characters to read."""
    out = asdict(reply)
    text = out.pop("text")
    return {**out, "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "text_chars": len(text),
            "text_head": text[:80]}


def identity(rows: list[dict]) -> None:
    """Mark each system's workloads with whether every reply's text equals its twin's
    with drafts off (same server kind, greedy), and the speedup of drafts in total time."""
    by_name = {r["system"]: r for r in rows}
    for row in rows:
        twin = by_name.get(TWIN.get(row["system"], ""))
        if not twin or "workloads" not in row or "workloads" not in twin:
            continue
        for name, w in row["workloads"].items():
            other = twin["workloads"].get(name)
            if other is None or w["errors"] or other["errors"]:
                continue  # a failed request's text says nothing about identity
            texts = [r["text_sha256"] for r in w["replies"]]
            theirs = [r["text_sha256"] for r in other["replies"]]
            w["identical_to_drafts_off"] = texts == theirs
            w["differing_replies"] = sum(a != b for a, b in zip(texts, theirs)) + abs(len(texts) - len(theirs))
            if w["total_s"] > 0:
                w["speedup_total"] = round(other["total_s"] / w["total_s"], 3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a GGUF path (the same file for both)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=4,
                    help="code-edit requests (half repeat, half rename); prose, chat: up to 4 each")
    ap.add_argument("--turns", type=int, default=0, help="agent turns to run (0: all)")
    ap.add_argument("--max-tokens", type=int, default=0, help="per reply (0: 400 code, 300 prose, 200 agent)")
    ap.add_argument("--llama-cpp", default=LLAMA_CPP, help="llama.cpp's binaries (llama-server)")
    ap.add_argument("--llama-spec", default=LLAMA_SPEC, help="llama-server's speculation flags for llama-server-ngram")
    ap.add_argument("--context", type=int, default=8192, help="llama-server's context")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    ap.add_argument("--text", action="store_true",
                    help="send each conversation as plain text to /v1/completions (a base model: gemma3 always)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="JustFit only, one server: each workload N times with drafts on and off, alternating (0: off)")
    ap.add_argument("--in-process", action="store_true",
                    help="with --rounds: this process's engine, decode timed in CPU seconds (no server)")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    args = ap.parse_args(argv)
    args.text = args.text or args.model == "gemma3"  # a base model: its chat routes refuse it
    args.systems, args.workloads = args.systems.split(","), args.workloads.split(",")
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(set(args.systems) - set(SYSTEMS))}: choose from {', '.join(SYSTEMS)}")
    if set(args.workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(set(args.workloads) - set(WORKLOADS))}: choose from {', '.join(WORKLOADS)}")
    from bench.common import machine_info
    from bench.report import publish

    settings = {k: getattr(args, k) for k in ("model", "prompts", "turns", "max_tokens", "llama_spec", "context", "text",
                                              "rounds", "in_process")}
    if args.rounds:
        rows = [alternate_in_process(args) if args.in_process else asyncio.run(alternate(make_system("justfit", args), args))]
        publish("speculation", {"machine": machine_info(), "settings": {**settings, "cores": os.cpu_count()},
                                "systems": rows}, args.json)
        return
    rows = [asyncio.run(measure(make_system(name, args), args)) for name in args.systems]  # one server at a time
    identity(rows)
    responses_over_chat(rows)
    publish("speculation", {"machine": machine_info(), "settings": {**settings, "cores": os.cpu_count()},
                            "systems": rows}, args.json)


if __name__ == "__main__":
    main()

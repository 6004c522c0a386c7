"""Network hygiene of `justfit serve`: read timeouts and the connection limit (500
stalled connections while /health answers), prompts refused by their size before
tokenizing (an 8 MB prompt on every generation route), tokenization off the event
loop on the Anthropic routes, CORS headers on every response, and no exception text
in any response (API keys: test_server_keys.py). `--long` runs the flood at one byte
a minute with the default timeouts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import ClientSession, ClientTimeout

from justfit import Engine
from justfit.config import EngineConfig
from tests.helpers.server_harness import CHAT, Gate, LiveServer, Starting, health_latency, request

ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 0.6  # a timer's close, seen by the client: loop and scheduling delays on a shared machine
EARLY_S = 0.8  # a 1 s timeout, seen by a client that noted its connect late (a loaded machine)
HEALTH_UNDER_FLOOD_S = 0.1
HEALTH_BESIDE_8MB_S = 0.05
REFUSED_WITHIN_S = 0.1
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def engine(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16))


@pytest.fixture(scope="module")
def timed(engine):
    """A server with short read timeouts."""
    s = LiveServer(engine, header_timeout_s=1.0, body_timeout_s=1.0, idle_timeout_s=2.0)
    yield s
    s.close()


# -- raw connections ----------------------------------------------------------------------
async def _until_closed(port: int, parts: list[bytes], gap: float = 0.0, limit: float = 10.0) -> tuple[float, bytes]:
    """Send `parts` (`gap` seconds apart), then read until the server closes: (seconds
    from the connect to the close, everything received)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start, got = time.monotonic(), b""
    try:
        for i, part in enumerate(parts):
            if i and gap:
                await asyncio.sleep(gap)
            writer.write(part)
        while chunk := await asyncio.wait_for(reader.read(65536), limit):
            got += chunk
    except ConnectionError:
        pass
    finally:
        writer.close()
    return time.monotonic() - start, got


async def _poll_health(port: int, done, every: float = 0.01) -> list[float]:
    """/health latencies, polled until `done()`."""
    latencies = []
    while not done():
        latencies.append(await health_latency(port))
        await asyncio.sleep(every)
    return latencies


def test_stalled_headers_and_silent_connections_are_closed_in_time(timed):
    async def go():
        return await asyncio.gather(
            _until_closed(timed.port, []),  # connects and says nothing
            _until_closed(timed.port, [b"GET /hea"]),  # half a request line
            _until_closed(timed.port, [b"GET /health HTTP/1.1\r\n", b"Host: x\r\n"], gap=0.3))  # headers unfinished

    before = timed.site.guard.closed["head"]
    for took, got in asyncio.run(go()):
        assert got == b"" and EARLY_S <= took < 1.0 + SLACK_S, took
    assert timed.site.guard.closed["head"] == before + 3


def test_stalled_body_gets_408_and_is_closed(timed):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    took, got = asyncio.run(_until_closed(timed.port, [head, b'{"messages": [']))
    status, _, body = got.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and EARLY_S <= took < 1.0 + SLACK_S, (took, got[:200])
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_body_answered_unread_still_times_out(engine):
    """A request refused before its body is read (401) does not hold the connection."""
    live = LiveServer(engine, api_key="k", body_timeout_s=1.0)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
        took, got = asyncio.run(_until_closed(live.port, [head, b"x" * 100]))
        assert got.startswith(b"HTTP/1.1 401") and EARLY_S <= took < 1.0 + SLACK_S, (took, got[:100])
    finally:
        live.close()


def test_keep_alive_and_slow_but_timely_requests_are_served(timed):
    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", timed.port)

        async def answer() -> bytes:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            return head + await reader.readexactly(length)

        for piece in (b"GET /hea", b"lth HTTP/1.1\r\nHost: x\r\n", b"\r\n"):  # 0.6 s: within the 1 s
            writer.write(piece)
            await asyncio.sleep(0.3)
        first = await answer()
        await asyncio.sleep(1.3)  # idle past the header timeout: a keep-alive connection waits longer
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        await asyncio.sleep(0.5)  # the body comes slowly, within its 1 s
        writer.write(body)
        second = await answer()
        idle_from = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return first, second, rest, time.monotonic() - idle_from

    first, second, rest, idle = asyncio.run(go())
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200") and rest == b""
    assert 1.8 <= idle < 2.0 + SLACK_S, idle  # then closed after the idle timeout


def test_a_long_generation_is_not_cut_by_the_timeouts(engine):
    gate = Gate(engine)
    live = LiveServer(gate, header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=0.5)
    try:
        threading.Timer(2.0, gate.open.set).start()  # the reply waits four timeouts' worth
        status, _, text = request(live, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert sum(live.site.guard.closed.values()) == 0
    finally:
        gate.open.set()
        live.close()


def test_the_listener_closes_with_its_runner(engine):
    live = LiveServer(engine)
    assert request(live, "GET", "/health")[0] == 200 and live.site.guard.peak == 1
    live.close()
    with pytest.raises(OSError):  # the port is free: nothing listens
        asyncio.run(asyncio.open_connection("127.0.0.1", live.port))


class _Transport(asyncio.Transport):
    """Just enough of a socket's transport for the guard: no socket, closes noted."""

    def __init__(self):
        super().__init__()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return default

    def get_write_buffer_size(self):
        return 0

    def close(self):
        self.closed = True

    abort = close


def test_a_complete_request_head_is_never_closed_to_make_room():
    """Between its head's arrival and the app's taking it (a turn of the loop, longer on a
    loaded machine) a connection is not stalled: a burst of new connections closes the
    stalled ones around it, not it, even where its head came in pieces."""
    from justfit.server.connections import Guard, GuardedProtocol, Limits

    async def go():
        guard = Guard(Limits(max_connections=3))

        def connect(*sent: bytes) -> GuardedProtocol:
            conn = GuardedProtocol(asyncio.Protocol(), guard)
            conn.connection_made(_Transport())
            for part in sent:
                conn.data_received(part)
            return conn

        complete = connect(b"GET /health HTTP/1.1\r\nHost: t\r", b"\n\r", b"\n")
        stalled = [connect(b"GET /hea"), connect()]
        newcomers = [connect() for _ in range(4)]
        return complete, stalled, newcomers, guard

    complete, stalled, newcomers, guard = asyncio.run(go())
    assert not complete.transport.closed and complete in guard.open
    assert all(c.transport.closed for c in stalled + newcomers[:2]) and guard.closed["evicted"] == 4
    assert list(guard.open) == [complete, *newcomers[2:]]


# -- 500 stalled connections ---------------------------------------------------------------
def _flood(engine, n: int, interval: float, hold: float, **config) -> tuple[dict, list[float], LiveServer]:
    """`n` slow clients (their own process: tests/helpers/slow_clients.py) against a server with
    `config`, /health polled on new connections the whole time: (what the clients saw,
    every /health latency, the server, closed)."""
    live = LiveServer(engine, **config)
    timeout = live.server.config.header_timeout_s
    try:
        child = subprocess.Popen([sys.executable, "-m", "tests.helpers.slow_clients", str(live.port), "--n", str(n),
                                  "--interval", str(interval), "--hold", str(hold), "--wait", str(timeout + 5)],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
        latencies = asyncio.run(_poll_health(live.port, lambda: child.poll() is not None))
        seen = json.loads(child.stdout.read())  # a few numbers: the pipe never fills
    finally:
        live.close()
    return seen, latencies, live


def _check_flood(seen: dict, latencies: list[float], live: LiveServer, n: int) -> tuple[float, float]:
    """What must hold whatever the machine's load (every stalled connection closed, by
    its timeout or to make room); (the worst /health latency, the longest a stalled
    connection lived beyond its header timeout)."""
    guard, timeout = live.site.guard, live.server.config.header_timeout_s
    print(f"\n{n} stalled connections, limit {guard.limits.max_connections}: /health max "
          f"{max(latencies) * 1000:.1f} ms over {len(latencies)} polls; {seen['closed']} connections, longest "
          f"{seen['longest']:.2f} s (timeout {timeout:g} s); closed {dict(guard.closed)}; peak open {guard.peak}")
    assert seen["never_closed"] == 0 and seen["connected"] >= n and seen["closed"] == seen["connected"]
    assert guard.peak <= guard.limits.max_connections and len(latencies) > 20
    assert guard.closed["head"] + guard.closed["evicted"] == seen["connected"]
    if guard.limits.max_connections > n + 50:  # room for all: each one held to its timeout
        assert guard.closed["evicted"] == 0
    else:  # the oldest stalled ones made room for the new
        assert guard.closed["evicted"] > 0
    return max(latencies), seen["longest"] - timeout


def _best_of(attempts: int, run) -> list[tuple[float, float]]:
    """`run()` until its (latency, lateness) are within the targets, `attempts` times at
    most: a loaded machine's scheduling delays show up as latency now and then, a
    blocked event loop in every attempt. Every pair seen."""
    seen = []
    while len(seen) < attempts and (not seen or seen[-1][0] >= HEALTH_UNDER_FLOOD_S or seen[-1][1] >= SLACK_S):
        seen.append(run())
    return seen


@pytest.mark.parametrize("limit", [256, 1024])
def test_500_stalled_connections_never_lock_out_health(engine, limit):
    """The default limit (256: the flood is evicted, oldest first) and one above the flood
    (every stalled connection held until its header timeout)."""
    seen = _best_of(3, lambda: _check_flood(*_flood(engine, 500, interval=0.25, hold=3.0, header_timeout_s=1.5,
                                                    max_connections=limit), 500))
    assert seen[-1][0] < HEALTH_UNDER_FLOOD_S and seen[-1][1] < SLACK_S, seen


@pytest.mark.skipif("not config.getoption('--long')", reason="long variant: --long")
def test_500_connections_sending_a_byte_a_minute(engine):
    """The target as stated: one byte a minute, the default timeouts and limit, for a
    minute and more (each slot reconnecting once closed)."""
    seen = _best_of(2, lambda: _check_flood(*_flood(engine, 500, interval=60.0, hold=65.0), 500))
    assert seen[-1][0] < HEALTH_UNDER_FLOOD_S and seen[-1][1] < SLACK_S, seen


# -- prompts refused by their size ----------------------------------------------------------
def _messages(p):
    return [{"role": "user", "content": p}]


GENERATION_ROUTES = {
    "/v1/chat/completions": lambda p: {"messages": _messages(p), "max_tokens": 1},
    "/v1/completions": lambda p: {"prompt": p, "max_tokens": 1},
    "/api/chat": lambda p: {"messages": _messages(p), "stream": False},
    "/api/generate": lambda p: {"prompt": p, "stream": False},
    "/v1/messages": lambda p: {"model": "claude-test", "max_tokens": 1, "messages": _messages(p)},
    "/v1/messages/count_tokens": lambda p: {"model": "claude-test", "messages": _messages(p)},
    "/v1/responses": lambda p: {"input": p, "max_output_tokens": 1},
}


def _refusal(path: str, body: dict) -> str:
    """The refusal's message, checked to be the size one in the route's error shape."""
    if path.startswith("/api/"):
        return body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded" and body["error"]["details"]["prompt_bytes"] >= 8e6
    return body["error"]["message"]


def test_an_8mb_prompt_is_refused_at_once_on_every_generation_route(engine):
    live = LiveServer(engine)
    prompt = "All work and no play makes Jack a dull boy. " * (8 * 2**20 // 44)
    bodies = {path: json.dumps(make(prompt)).encode() for path, make in GENERATION_ROUTES.items()}

    async def once(session: ClientSession, path: str) -> tuple[int, dict, float, float]:
        """(status, body, seconds to the refusal, the worst /health latency meanwhile)."""
        done = False
        poll = asyncio.create_task(_poll_health(live.port, lambda: done, every=0.002))
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        async with session.post(live.url + path, data=bodies[path], headers={"Content-Type": "application/json"}) as r:
            status, body = r.status, await r.json()
        took = time.perf_counter() - start
        done = True
        return status, body, took, max(await poll)

    async def go() -> dict:
        out = {}
        async with ClientSession(timeout=ClientTimeout(total=60)) as session:
            for path in bodies:  # up to 3 tries each, as in _best_of: a loaded machine's delays
                tries = [await once(session, path)]
                while len(tries) < 3 and (tries[-1][2] >= REFUSED_WITHIN_S or tries[-1][3] >= HEALTH_BESIDE_8MB_S):
                    tries.append(await once(session, path))
                out[path] = tries
        return out

    try:
        results = asyncio.run(go())
    finally:
        live.close()
    for path, tries in results.items():
        status, body, took, health = tries[-1]
        print(f"\n{path}: 8 MiB refused in {took * 1000:.1f} ms, /health at most {health * 1000:.1f} ms meanwhile"
              + (f" (try {len(tries)}: {[(round(t[2] * 1000), round(t[3] * 1000)) for t in tries]} ms)"
                 if len(tries) > 1 else ""))
        assert all(t[0] == 400 and "too long" in _refusal(path, t[1]) for t in tries), (path, body)
        assert took < REFUSED_WITHIN_S and health < HEALTH_BESIDE_8MB_S, (path, took, health)


def test_the_size_bound_holds_for_the_vocabulary(engine):
    """The bound is the longest token's bytes; a prompt at it is tokenized, not refused."""
    from justfit.server.prompt_bytes import longest_token_bytes

    longest = longest_token_bytes(engine.tokenizer)
    vocab = engine.tokenizer.vocab
    assert longest == max(len(t) for t in vocab)  # byte-level: a character per byte; "<|endoftext|>" here
    allowed = "x" * (engine.context_limit * longest)  # far more tokens than fit, but not by size alone
    live = LiveServer(engine)
    try:
        status, _, text = request(live, "POST", "/v1/completions", {"prompt": allowed, "max_tokens": 1})
        err = json.loads(text)["error"]
        assert status == 400 and err["details"]["prompt_tokens"] == len(engine.encode(allowed))  # counted
        status, _, text = request(live, "POST", "/v1/completions", {"prompt": allowed + "x", "max_tokens": 1})
        err = json.loads(text)["error"]
        assert status == 400 and err["details"]["max_prompt_bytes"] == len(allowed)  # by size
    finally:
        live.close()


def test_the_size_bound_per_tokenizer_layout():
    """Byte-level vocabularies count a character per byte, others their UTF-8 bytes;
    normalizers that shrink text by a bounded ratio scale the bound, anything that may
    drop text turns the check off."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from justfit.server.prompt_bytes import longest_token_bytes

    def bpe(vocab, normalizer=None, pre=None, **kw) -> Tokenizer:
        t = Tokenizer(models.BPE(vocab, [], **kw))
        if normalizer is not None:
            t.normalizer = normalizer
        if pre is not None:
            t.pre_tokenizer = pre
        return t

    byte_level = bpe({"\u0120" * 6: 0, "abc": 1}, pre=pre_tokenizers.ByteLevel())  # six spaces, 12 UTF-8 bytes
    spm = [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    pieces = {"\u2581the": 0, "<0x41>": 1}  # 6 and 6 bytes
    special = bpe({"a": 0}, pre=pre_tokenizers.ByteLevel())
    special.add_special_tokens(["<|a-long-special-token|>"])
    assert longest_token_bytes(byte_level) == 6
    assert longest_token_bytes(special) == len("<|a-long-special-token|>")
    assert longest_token_bytes(bpe(pieces, normalizers.Sequence(spm), byte_fallback=True)) == 6
    assert longest_token_bytes(bpe(pieces, normalizers.Sequence([normalizers.NFKC(), *spm]),
                                   byte_fallback=True)) == 6 * 4  # "𝐀" (4 bytes) becomes "A"
    for drops in (bpe(pieces, normalizers.Strip(), byte_fallback=True),  # strips spaces
                  bpe(pieces, pre=pre_tokenizers.Whitespace(), byte_fallback=True),  # drops them
                  bpe(pieces, normalizers.Replace("  ", " "), byte_fallback=True),  # collapses them
                  bpe({**pieces, "<unk>": 2}, unk_token="<unk>", fuse_unk=True),  # one token for any unknown run
                  Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))):  # for any unknown word
        assert longest_token_bytes(drops) is None


# -- the Anthropic routes off the loop --------------------------------------------------------
TEMPLATE_HOLD_S = 1.0  # each chat template call's forced time


def test_anthropic_routes_tokenize_off_the_event_loop(tiny_gemma3_dir):
    """A loop that templated and tokenized itself would miss /health polls for the
    template's whole hold; half of it leaves a loaded machine's scheduling delays room."""
    engine = Engine(str(tiny_gemma3_dir), config=EngineConfig(context_limit=16384))
    template, threads = engine.apply_chat_template, []

    def slow_template(*args, **kwargs):  # where it runs, and as slow as a big prompt's template
        threads.append(threading.current_thread().name)
        out = template(*args, **kwargs)
        time.sleep(TEMPLATE_HOLD_S)
        return out

    engine.apply_chat_template = slow_template
    msgs = _messages("all work and no play " * 1000)  # 21 KB: within the size bound, 20K tokens
    expected = len(template(msgs))
    live = LiveServer(engine)

    async def go(path, body):
        async with ClientSession(timeout=ClientTimeout(total=60)) as session:
            async def send():
                async with session.post(live.url + path, json=body) as r:
                    return r.status, await r.json()

            task = asyncio.create_task(send())
            latencies = await _poll_health(live.port, task.done, every=0.02)
            return *(await task), latencies

    try:
        status, counted, polls = asyncio.run(go("/v1/messages/count_tokens", {"model": "claude-x", "messages": msgs}))
        assert status == 200 and counted["input_tokens"] == expected
        assert len(polls) >= 10 and max(polls) < TEMPLATE_HOLD_S / 2, max(polls)
        status, refused, polls = asyncio.run(go("/v1/messages", {"model": "claude-x", "max_tokens": 8,
                                                                  "messages": msgs}))
        assert status == 400 and "prompt too long" in refused["error"]["message"]  # planned: by count
        assert len(polls) >= 10 and max(polls) < TEMPLATE_HOLD_S / 2, max(polls)
        assert threads and all(name.startswith("justfit-tokenizer") for name in threads)
    finally:
        live.close()


# -- CORS --------------------------------------------------------------------------------------
def test_cors_headers_on_every_response(engine):
    live = LiveServer(engine, cors_origin=ORIGIN, api_key="k", max_body_bytes=4096)
    key = {"Authorization": "Bearer k"}
    try:
        answers = {
            "openai stream": request(live, "POST", "/v1/chat/completions", {**CHAT, "stream": True}, headers=key),
            "anthropic stream": request(live, "POST", "/v1/messages", {
                "model": "claude-x", "max_tokens": 2, "messages": CHAT["messages"], "stream": True}, headers=key),
            "ollama stream": request(live, "POST", "/api/chat", {"messages": CHAT["messages"],
                                                                 "options": {"num_predict": 2}}, headers=key),
            "400": request(live, "POST", "/v1/chat/completions", raw=b"{not json", headers=key),
            "401": request(live, "GET", "/v1/models"),
            "404": request(live, "GET", "/v1/nothing", headers=key),
            "405": request(live, "GET", "/v1/chat/completions", headers=key),
            "413": request(live, "POST", "/v1/completions", raw=b'{"prompt": "' + b"a" * 5000 + b'"}', headers=key),
            "preflight": request(live, "OPTIONS", "/v1/chat/completions"),
        }
    finally:
        live.close()
    statuses = {name: status for name, (status, _, _) in answers.items()}
    assert statuses == {"openai stream": 200, "anthropic stream": 200, "ollama stream": 200, "400": 400,
                        "401": 401, "404": 404, "405": 405, "413": 413, "preflight": 204}
    for name, (_, headers, _) in answers.items():
        assert headers.get("Access-Control-Allow-Origin") == ORIGIN, name
        assert "X-JustFit-Ticket" in headers["Access-Control-Expose-Headers"], name
    assert "Authorization" in answers["preflight"][1]["Access-Control-Allow-Headers"]
    assert "POST" in answers["preflight"][1]["Access-Control-Allow-Methods"]


# -- no exception text in responses -------------------------------------------------------------
SECRET = "/private/var/secret-path: a library's own words"


class Failing(Starting):
    """An engine whose every request fails, as it starts, with a message no client may read."""

    def __init__(self, engine):
        super().__init__(engine, _fail)


def _fail() -> None:
    raise RuntimeError(SECRET)


def test_failures_answer_a_stable_message_never_the_exception(engine):
    live = LiveServer(Failing(engine))
    msgs = CHAT["messages"]
    try:
        answers = [
            request(live, "POST", "/api/chat", {"messages": msgs, "options": {"num_predict": 2}}),  # NDJSON stream
            request(live, "POST", "/api/generate", {"prompt": "hi", "options": {"num_predict": 2}}),
            request(live, "POST", "/v1/chat/completions", {**CHAT, "stream": True}),
            request(live, "POST", "/v1/chat/completions", CHAT),
            request(live, "POST", "/v1/messages", {"model": "claude-x", "max_tokens": 2, "messages": msgs,
                                                   "stream": True}),
            request(live, "POST", "/v1/chat/completions", raw=b'{"messages": [}'),
        ]
        live.server.engine._engine = _Broken(engine, ValueError(SECRET))
        answers.append(request(live, "POST", "/v1/chat/completions", CHAT))
    finally:
        live.close()
    for status, _, text in answers:
        assert SECRET not in text and "RuntimeError" not in text and "Traceback" not in text, text
    assert json.loads(answers[0][2].splitlines()[-1]) == {"error": "internal error while generating"}
    assert answers[3][0] == 500 and answers[5][0] == 400 and "line 1" in json.loads(answers[5][2])["error"]["message"]
    assert answers[6][0] == 400 and json.loads(answers[6][2])["error"]["code"] == "chat_template_failed"


class _Broken:
    """`engine` with a chat template that raises `error`."""

    def __init__(self, engine, error):
        self._engine, self._error = engine, error

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def apply_chat_template(self, *args, **kwargs):
        raise self._error

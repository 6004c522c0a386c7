"""One pump from a job's events (justfit.engine.events) to a route's reply. It owns what
every API family shares: the event loop (keep-alive ticks, prefill progress, tokens,
a failure with its stable code and HTTP status, the end with its stats), tool-call
spans held back from the visible text (a forced tool call's reply read as the calls'
JSON instead, streamed as call pieces: justfit.server.tools), log-probability entries
(on the tokenizer thread), the session state made durable before the reply's end, the client going away
(the job cancelled) and the job cancelled whenever the reply ends. An API family only
formats: a `Format` turns each step into the bytes of its stream, or a whole reply into
its JSON body (justfit.server.openai_format, ollama_format, anthropic_format)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from justfit.engine.events import End, Failure, Progress, Tick, Token
from justfit.server.failures import failure_answer
from justfit.server.logprobs import chat_entries, chat_entry
from justfit.server.schema import BadRequest
from justfit.server.sessions import STATE_HEADER, StateOutcome, state_outcome
from justfit.server.tools import JsonCalls, ToolCalls, ToolMode

if TYPE_CHECKING:
    from justfit.engine.stats import GenerationStats

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Ending:
    """What a stream's end is made of, once the job's End arrived."""

    stats: GenerationStats | None  # None: cancelled before it ran, or failed
    stored: StateOutcome | None  # the turn's session state, where the format reports it
    tail: str  # visible text held back until the end (what looked like a tool-call marker's start)
    calls: list[dict]  # every tool call of the reply (streamed as pieces or not), OpenAI's shape, indexed
    token_ids: list[int]  # the tokens generated


@dataclass(frozen=True)
class Whole:
    """A whole reply, for an answer that is not streamed."""

    text: str  # the visible text
    calls: list[dict]  # the tool calls parsed from it, OpenAI's shape
    stats: GenerationStats | None  # None: cancelled before it ran
    entries: list[dict]  # the tokens' log-probability entries, where the format asks for them
    token_ids: list[int]  # the tokens generated
    stored: StateOutcome | None  # the turn's session state, where the format reports it


class Format(Protocol):
    """One reply in one API family's shape. The stream hooks return the pieces to
    write, in order (each written on its own, as the reply's chunks)."""

    headers: dict  # the stream's response headers
    keepalive: bool  # whether a silent stream gets Ticks (comments, pings)
    ends_on_failure: bool  # whether a stream ends at a failure rather than at the End
    reports_state: bool  # whether the reply says what became of the session state
    logprob_entries: bool  # whether tokens' log-probabilities are turned into entries

    def opening(self, ahead: int) -> list[bytes]:
        """The stream's first pieces (`ahead`: requests before it in the queue)."""
    def tick(self, tick: Tick) -> list[bytes]:
        """Pieces for a silent stretch (queued, or a long prefill chunk)."""
    def progress(self, progress: Progress) -> list[bytes]:
        """Pieces for the prompt's progress."""
    def token(self, shown: str, entry: dict | None) -> list[bytes]:
        """Pieces for the text `shown` (tool-call spans held back) and its log-probability entry."""
    def call_pieces(self, pieces: list) -> list[bytes]:
        """Pieces for tool calls streamed as they are generated (tools.CallStart, CallArguments)."""
    def failure(self, answer: BadRequest) -> list[bytes]:
        """Pieces for a failure, answered as the family answers errors."""
    def ending(self, ending: Ending) -> list[bytes]:
        """The stream's last pieces: held-back text, tool calls, finish reason, usage."""
    def whole(self, reply: Whole) -> dict:
        """The JSON body of a reply not streamed."""


async def reply(server, request: web.Request, job, fmt: Format, mode: ToolMode | None, stream: bool,
                ahead: int = 0) -> web.StreamResponse:
    """`job`'s reply to `request` in `fmt`'s shape, streamed or whole (`mode`: how the
    reply's tool calls are read out of its text; None: no tools)."""
    calls = (mode or ToolMode()).reader(server.engine.tokenizer)
    try:
        if stream:
            return await _stream(server, request, job, fmt, calls, ahead)
        return await _whole(server, job, fmt, calls)
    finally:
        job.cancel.set()  # a no-op once finished; stops the work if the client left


async def _whole(server, job, fmt: Format, tools: ToolCalls | JsonCalls) -> web.Response:
    """Every event first, then one JSON answer; a failure raised as the client's answer."""
    parts, chunks, stats, failure = [], [], None, None
    async for event in job.stream():
        if isinstance(event, Token):
            parts.append(tools.feed(event.chunk.text))
            chunks.append(event.chunk)
        elif isinstance(event, Failure):
            failure = event
        elif isinstance(event, End):
            stats = event.stats
    if failure is not None:
        raise failure_answer(failure)
    parts.append(tools.flush())
    entries = (await server.tokenizing.run(chat_entries, server.engine.tokenizer, chunks)
               if fmt.logprob_entries else [])
    stored = await _stored(server, fmt, stats)  # durable before the answer
    ids = [c.token for c in chunks if c.token is not None]
    resp = web.json_response(fmt.whole(Whole("".join(parts), tools.calls(), stats, entries, ids, stored)))
    if stored is not None:
        resp.headers[STATE_HEADER] = stored.header()
    return resp


async def _stream(server, request, job, fmt: Format, tools: ToolCalls | JsonCalls, ahead: int) -> web.StreamResponse:
    """The events as they come, in `fmt`'s stream; the client leaving cancels the job."""
    resp = web.StreamResponse(headers=fmt.headers)
    await resp.prepare(request)
    tick = server.config.keepalive_s if fmt.keepalive else None
    try:
        await _write(resp, fmt.opening(ahead))
        stats, ids = None, []
        async for event in job.stream(tick):
            if isinstance(event, Failure):
                await _write(resp, fmt.failure(failure_answer(event)))
                if fmt.ends_on_failure:
                    break
            elif isinstance(event, End):
                stats = event.stats
            elif isinstance(event, Token):
                ids += [event.chunk.token] if event.chunk.token is not None else []
                await _write(resp, fmt.token(tools.feed(event.chunk.text), await _entry(server, fmt, event)))
                pieces = tools.pieces()
                if pieces:
                    await _write(resp, fmt.call_pieces(pieces))
            else:
                await _write(resp, fmt.tick(event) if isinstance(event, Tick) else fmt.progress(event))
        else:  # the End came: the reply's end, after the session state is durable
            stored = await _stored(server, fmt, stats)
            await _write(resp, fmt.ending(Ending(stats, stored, tools.flush(), tools.calls(streaming=True), ids)))
        await resp.write_eof()
    except ConnectionError:  # the client left: cancel, nobody to tell
        job.cancel.set()
    return resp


async def _entry(server, fmt: Format, token: Token) -> dict | None:
    """The token's log-probability entry, where asked (its text: a tokenizer call, so on its thread)."""
    if not fmt.logprob_entries or token.chunk.logprob is None:
        return None
    return await server.tokenizing.run(chat_entry, server.engine.tokenizer, token.chunk)


async def _stored(server, fmt: Format, stats) -> StateOutcome | None:
    return await state_outcome(stats, server.config.write_wait_s) if fmt.reports_state else None


async def _write(resp: web.StreamResponse, pieces: list[bytes]) -> None:
    for piece in pieces:
        if piece:
            await resp.write(piece)

"""Anthropic's Messages API shapes for the pump (justfit.server.pump): a reply streamed
as Anthropic's named SSE events or whole, and Anthropic's error shape (app.py's
middleware answers /v1/messages errors with it)."""

from __future__ import annotations

import json
import uuid

from justfit.engine.events import Progress, Tick
from justfit.server.pump import SSE_HEADERS, Ending, Whole
from justfit.server.schema import BadRequest
from justfit.server.sessions import stream_note
from justfit.server.tools import CallStart

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def usage(prompt: int, cached: int, output: int, stats=None) -> dict:
    """Anthropic counts input tokens served from a cache apart from the rest; a finished
    reply's `stats` add speculative decoding's drafted and accepted tokens and the tokens a
    grammar forced."""
    out = {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
           "cache_creation_input_tokens": 0}
    if stats is not None:
        out.update(drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
                   forced_tokens=stats.forced_tokens)
    return out


def tool_blocks(calls: list[dict]) -> list[dict]:
    """Parsed tool calls (OpenAI's shape, arguments as JSON text) as tool_use blocks."""
    out = []
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = {}
        out.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                    "name": call["function"]["name"], "input": args if isinstance(args, dict) else {"value": args}})
    return out


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic's tool_use id."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(stats, calls: list) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished reply (max_tokens even mid-call)."""
    if calls and not (stats is not None and stats.finish_reason == "length"):
        return "tool_use", None
    if stats is not None and stats.stop_sequence:
        return "stop_sequence", stats.stop_sequence
    return STOP_REASONS.get(stats.finish_reason if stats else "stop", "end_turn"), None


def event(kind: str, data: dict) -> bytes:
    """One named event of Anthropic's SSE stream, its data carrying the type too."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def tool_events(calls: list[dict], first: int) -> list[bytes]:
    """Streamed tool_use blocks from index `first`: each opens with an empty input,
    which one input_json_delta fills (the call is parsed whole, once it ended)."""
    out = []
    for index, block in enumerate(tool_blocks(calls), first):
        args = json.dumps(block.pop("input"))
        out += [event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                        "partial_json": args}}),
                event("content_block_stop", {"index": index})]
    return out


class AnthropicFormat:
    """One reply of /v1/messages. A stream opens its message at the first event (with the
    positions a stored state held, when that event is the first progress report) and its
    text block at the first text; that state moves on as it is written."""

    headers = SSE_HEADERS
    keepalive, ends_on_failure, reports_state, logprob_entries = True, True, True, False

    def __init__(self, model: str, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model}
        self.started, self.text_open, self.call_open = False, False, False
        self.blocks = 0  # the index of the block open or next
        self.streamed_calls = 0  # tool calls already streamed as pieces (a forced tool_choice)

    def _start(self, cached: int) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [event("message_start", {"message": {**self.head, "content": [], "stop_reason": None,
                                                    "stop_sequence": None,
                                                    "usage": usage(self.prompt_tokens, cached, 0)}})]

    def _close(self) -> list[bytes]:
        """The open block's end, if one is open."""
        if not (self.text_open or self.call_open):
            return []
        self.text_open = self.call_open = False
        self.blocks += 1
        return [event("content_block_stop", {"index": self.blocks - 1})]

    def _text(self, piece: str) -> list[bytes]:
        out = [] if self.text_open else self._close()
        if not self.text_open:
            self.text_open = True
            out += [event("content_block_start", {"index": self.blocks, "content_block": {"type": "text", "text": ""}}),
                    event("ping", {})]
        if piece:
            out.append(event("content_block_delta", {"index": self.blocks,
                                                     "delta": {"type": "text_delta", "text": piece}}))
        return out

    # -- streamed -------------------------------------------------------------------------
    def opening(self, ahead: int) -> list[bytes]:
        """Nothing: the message starts with the first event that knows its cached tokens."""
        return []

    def tick(self, tick: Tick) -> list[bytes]:
        """Queued, or a long prefill chunk: keep the connection alive."""
        return self._start(0) + [event("ping", {})]

    def progress(self, progress: Progress) -> list[bytes]:
        """The message's start, once: the first report says what the stored state held."""
        return self._start(progress.processed)  # the first report: what the stored state held

    def token(self, shown: str, entry: dict | None) -> list[bytes]:
        """A text delta in the open text block."""
        return self._start(0) + (self._text(shown) if shown else [])

    def call_pieces(self, pieces: list) -> list[bytes]:
        """A tool_use block opened per call, its input streamed as input_json_delta events."""
        out = self._start(0)
        for piece in pieces:
            if isinstance(piece, CallStart):
                out += self._close()
                self.call_open, self.streamed_calls = True, piece.index + 1
                block = {"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name, "input": {}}
                out.append(event("content_block_start", {"index": self.blocks, "content_block": block}))
            else:
                out.append(event("content_block_delta", {"index": self.blocks, "delta": {
                    "type": "input_json_delta", "partial_json": piece.text}}))
        return out

    def failure(self, answer: BadRequest) -> list[bytes]:
        """An `error` event in Anthropic's error shape."""
        return [event("error", {"error": anthropic_error(answer)})]

    def ending(self, ending: Ending) -> list[bytes]:
        """The text block closed, tool-use blocks, the stop reason and usage, message_stop."""
        out = self._start(0) + [stream_note(ending.stored)]
        if ending.tail or not ending.calls:
            out += self._text(ending.tail)
        out += self._close()
        out += tool_events([c for c in ending.calls if c["index"] >= self.streamed_calls], self.blocks)
        reason, sequence = stop_reason(ending.stats, ending.calls)
        return out + [event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": self._usage(ending.stats)}),
                      event("message_stop", {})]

    # -- whole ----------------------------------------------------------------------------
    def whole(self, reply: Whole) -> dict:
        """An Anthropic message: text and tool-use blocks, stop reason, usage."""
        content = ([{"type": "text", "text": reply.text}] if reply.text or not reply.calls else [])
        reason, sequence = stop_reason(reply.stats, reply.calls)
        return {**self.head, "content": content + tool_blocks(reply.calls), "stop_reason": reason,
                "stop_sequence": sequence, "usage": self._usage(reply.stats)}

    def _usage(self, stats) -> dict:
        cached = stats.cached_tokens if stats else 0
        return usage(self.prompt_tokens, cached, stats.generated_tokens if stats else 0, stats)


# -- errors -------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(e: BadRequest) -> dict:
    """The inner `error` object of Anthropic's error body."""
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error"),
            "message": message}


def error_body(e: BadRequest) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": anthropic_error(e)}

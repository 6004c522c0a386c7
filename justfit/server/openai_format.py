"""OpenAI's reply shapes for the pump (justfit.server.pump): chat and text completions,
streamed as SSE (prefill progress and keep-alives as comment lines, which clients
ignore but which keep connections alive through a long prompt) or whole."""

from __future__ import annotations

import json
import time
import uuid

from justfit.engine.events import Progress, Tick
from justfit.server.logprobs import chat_logprobs, completion_logprobs
from justfit.server.pump import SSE_HEADERS, Ending, Whole
from justfit.server.schema import BadRequest
from justfit.server.sessions import stream_note
from justfit.server.tools import CallStart


def usage(stats) -> dict:
    """OpenAI's usage object for a generation (zeros without stats), with speculative
    decoding's drafted and accepted tokens and the tokens a grammar forced as extra keys
    (the openai client keeps them)."""
    prompt = stats.prompt_tokens if stats else 0
    done = stats.generated_tokens if stats else 0
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats else 0},
            "drafted_tokens": stats.drafted_tokens if stats else 0,
            "accepted_tokens": stats.accepted_tokens if stats else 0,
            "forced_tokens": stats.forced_tokens if stats else 0}


def finish_reason(stats, calls: list) -> str:
    """Why a reply ended: cut at max_tokens (length) even mid-call, else tool_calls where it called."""
    reason = stats.finish_reason if stats else "stop"
    return "tool_calls" if calls and reason != "length" else reason


def comment(text: str) -> bytes:
    """An SSE comment line."""
    return f": {text}\n\n".encode()


class OpenAIFormat:
    """One reply of /v1/chat/completions (`chat`) or /v1/completions. A stream's state
    (the cached positions, the logprobs of text not sent yet) moves on as it is written."""

    headers = SSE_HEADERS
    keepalive, ends_on_failure, reports_state = True, False, True

    def __init__(self, model_id: str, chat: bool, prompt_tokens: int, logprobs: bool, include_usage: bool):
        self.chat, self.include_usage = chat, include_usage
        self.logprob_entries = logprobs  # asked for: the reply carries them
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                     "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model_id}
        self.total, self.cached = prompt_tokens, None  # the prompt's positions; those a stored state held
        self.entries: list[dict] = []  # logprobs of tokens whose text is not sent yet
        self.sent_chars = 0
        self.streamed_calls = 0  # tool calls already streamed as pieces (a forced tool_choice)

    # -- streamed -------------------------------------------------------------------------
    def opening(self, ahead: int) -> list[bytes]:
        """A queued comment when requests are ahead; a chat's role delta."""
        queued = [comment(f"queued {json.dumps({'ahead': ahead})}")] if ahead else []
        return queued + ([self._piece(role="assistant", content="", refusal=None)] if self.chat else [])

    def tick(self, tick: Tick) -> list[bytes]:
        """A long prefill chunk (or the queue): say so, keep proxies awake."""
        s = tick.status
        if s.started is not None and not s.generated:
            return [self._prompt_progress(self.cached or 0, s.processed, tick.at - s.started)]
        return [comment("queued" if s.started is None else "keepalive")]

    def progress(self, progress: Progress) -> list[bytes]:
        """A prompt_progress comment."""
        self.total = progress.total
        self.cached = progress.processed if self.cached is None else self.cached
        return [self._prompt_progress(self.cached, progress.processed, progress.elapsed)]

    def token(self, shown: str, entry: dict | None) -> list[bytes]:
        """A choice delta with the text (its log-probabilities held until text is sent)."""
        if entry is not None:
            self.entries.append(entry)
        return [self._piece(shown)] if shown else []

    def call_pieces(self, pieces: list) -> list[bytes]:
        """Tool-call deltas: a call's id and name, then its arguments as they come."""
        out = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                self.streamed_calls = piece.index + 1
                call = {"index": piece.index, "id": piece.id, "type": "function",
                        "function": {"name": piece.name, "arguments": ""}}
            else:
                call = {"index": piece.index, "function": {"arguments": piece.text}}
            out.append(self._piece(tool_calls=[call]))
        return out

    def failure(self, answer: BadRequest) -> list[bytes]:
        """The error body as one data event."""
        return [f"data: {json.dumps(answer.body())}\n\n".encode()]

    def ending(self, ending: Ending) -> list[bytes]:
        """The state note, held-back text, tool calls, finish reason, usage, then [DONE]."""
        out = [stream_note(ending.stored), self._piece(ending.tail) if ending.tail else b""]
        unsent = [c for c in ending.calls if c["index"] >= self.streamed_calls]
        if unsent:
            out.append(self._piece(tool_calls=unsent))
        if ending.stats is not None:
            out.append(self._piece(reason=finish_reason(ending.stats, ending.calls)))
            if self.include_usage:
                out.append(self._data(None, usage=usage(ending.stats)))
        return out + [b"data: [DONE]\n\n"]

    def _prompt_progress(self, cached: int, processed: int, elapsed: float) -> bytes:
        info = {"total": self.total, "cached": cached, "processed": processed, "elapsed": round(elapsed, 3)}
        return comment(f"prompt_progress {json.dumps(info)}")

    def _data(self, choice: dict | None, **extra) -> bytes:
        body = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [choice] if choice else [], **extra}
        return f"data: {json.dumps(body)}\n\n".encode()

    def _piece(self, text: str | None = None, reason: str | None = None, **delta) -> bytes:
        """One choice delta; the logprobs held for text not sent yet go with its text."""
        logprobs = None
        if self.entries and (text or reason):
            logprobs = chat_logprobs(self.entries[:]) if self.chat else completion_logprobs(self.entries,
                                                                                             self.sent_chars)
            self.entries.clear()
        self.sent_chars += len(text or "")
        if self.chat:
            if text:
                delta["content"] = text
            return self._data({"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs})
        return self._data({"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs})

    # -- whole ----------------------------------------------------------------------------
    def whole(self, reply: Whole) -> dict:
        """A chat.completion or text_completion body."""
        reason = finish_reason(reply.stats, reply.calls)
        logprobs = None if not self.logprob_entries else (
            chat_logprobs(reply.entries) if self.chat else completion_logprobs(reply.entries))
        if self.chat:
            message = {"role": "assistant", "content": reply.text if reply.text or not reply.calls else None,
                       "refusal": None}
            if reply.calls:
                message["tool_calls"] = reply.calls
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": reply.text, "finish_reason": reason, "logprobs": logprobs}
        return {**self.head, "choices": [choice], "usage": usage(reply.stats)}

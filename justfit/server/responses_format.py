"""OpenAI's Responses API shapes for the pump (justfit.server.pump): the response
object (output items: an assistant message of output_text, function calls), its usage,
and its stream: named SSE events, each with a `sequence_number`, in the order the
official client's stream accumulator checks (response.created, response.in_progress,
output items opened, their content streamed and closed, then response.completed, or
response.incomplete when max_output_tokens ended it, or response.failed)."""

from __future__ import annotations

import json
import time
from typing import Callable

from justfit.engine.events import Progress, Tick
from justfit.server.openai_format import comment
from justfit.server.pump import SSE_HEADERS, Ending, Whole
from justfit.server.responses_request import new_id
from justfit.server.schema import BadRequest
from justfit.server.sessions import StateOutcome, stream_note
from justfit.server.tools import CallStart


def usage(stats) -> dict:
    """The Responses usage object (zeros without stats); speculative decoding's drafted
    and accepted tokens and the tokens a grammar forced as extra keys, as on chat completions."""
    prompt = stats.prompt_tokens if stats else 0
    done = stats.generated_tokens if stats else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": stats.cached_tokens if stats else 0},
            "output_tokens": done, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + done,
            "drafted_tokens": stats.drafted_tokens if stats else 0,
            "accepted_tokens": stats.accepted_tokens if stats else 0,
            "forced_tokens": stats.forced_tokens if stats else 0}


def message_item(item_id: str, text: str, status: str) -> dict:
    """The assistant's message output item."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    """An output_text content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, item_id: str | None = None) -> dict:
    """A tool call (chat completions' shape) as a function_call output item."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def status_of(stats) -> tuple[str, dict | None]:
    """The response's status and incomplete_details: a reply cut at its token limit is incomplete."""
    if stats is not None and stats.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def error_object(answer: BadRequest) -> dict:
    """A failed response's `error`."""
    return {"code": answer.code or answer.type, "message": answer.message}


Done = Callable[[dict, "StateOutcome | None", list], None]  # a finished response, its session state, its tokens


class ResponsesFormat:
    """One reply of POST /v1/responses. `head` is the response object's fixed part (id,
    model, the request's echoed fields); `done` is told the finished response (to store
    it) before its last event or its body goes out. A stream's state (the sequence
    number, the open message, the text so far) moves on as it is written."""

    headers = SSE_HEADERS
    keepalive, ends_on_failure, reports_state, logprob_entries = True, True, True, False

    def __init__(self, head: dict, prompt_tokens: int, done: Done | None = None):
        self.head = {"id": head.get("id") or new_id("resp"), "object": "response",
                     "created_at": int(time.time()), **head}
        self.prompt_tokens, self.done = prompt_tokens, done
        self.sequence, self.text, self.message_id = 0, [], None
        self.streamed: dict[int, tuple[int, str]] = {}  # a call streamed as pieces: its (output index, item id)
        self.result: dict | None = None  # the finished response object

    def response(self, status: str, output: list[dict], stats=None, incomplete: dict | None = None,
                 error: dict | None = None) -> dict:
        """The response object as it stands."""
        return {**self.head, "status": status, "error": error, "incomplete_details": incomplete,
                "output": output, "usage": usage(stats) if stats is not None else None}

    def _event(self, kind: str, **data) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    def _finish(self, output: list[dict], stats, stored: StateOutcome | None, token_ids: list[int]) -> dict:
        status, incomplete = status_of(stats)
        self.result = self.response(status, output, stats, incomplete)
        if self.done is not None:
            self.done(self.result, stored, token_ids)
        return self.result

    # -- streamed -------------------------------------------------------------------------
    def opening(self, ahead: int) -> list[bytes]:
        """response.created and response.in_progress (a queued comment first when requests are ahead)."""
        queued = [comment(f"queued {json.dumps({'ahead': ahead})}")] if ahead else []
        snapshot = self.response("in_progress", [])
        return queued + [self._event("response.created", response=snapshot),
                         self._event("response.in_progress", response=snapshot)]

    def tick(self, tick: Tick) -> list[bytes]:
        """A silent stretch (queued, a long prefill chunk): a comment keeps proxies awake."""
        return [comment("queued" if tick.status.started is None else "keepalive")]

    def progress(self, progress: Progress) -> list[bytes]:
        """The prompt's progress, as a comment (clients ignore comments)."""
        info = {"total": progress.total, "processed": progress.processed, "elapsed": round(progress.elapsed, 3)}
        return [comment(f"prompt_progress {json.dumps(info)}")]

    def token(self, shown: str, entry: dict | None) -> list[bytes]:
        """An output_text delta, the message and its text part opened first."""
        return self._delta(shown) if shown else []

    def _delta(self, piece: str) -> list[bytes]:
        out = []
        if self.message_id is None:
            self.message_id = new_id("msg")
            out += [self._event("response.output_item.added", output_index=0,
                                item={**message_item(self.message_id, "", "in_progress"), "content": []}),
                    self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                                content_index=0, part=text_part(""))]
        if piece:
            self.text.append(piece)
            out.append(self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                   content_index=0, delta=piece, logprobs=[]))
        return out

    def call_pieces(self, pieces: list) -> list[bytes]:
        """A forced call's item opened as it starts, its arguments as they are generated."""
        out = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                at = (self.message_id is not None) + len(self.streamed)
                self.streamed[piece.index] = (at, new_id("fc"))
                item = {"type": "function_call", "id": self.streamed[piece.index][1], "call_id": piece.id,
                        "name": piece.name, "arguments": "", "status": "in_progress"}
                out.append(self._event("response.output_item.added", output_index=at, item=item))
            elif piece.index in self.streamed:
                at, item_id = self.streamed[piece.index]
                out.append(self._event("response.function_call_arguments.delta", item_id=item_id, output_index=at,
                                       delta=piece.text))
        return out

    def failure(self, answer: BadRequest) -> list[bytes]:
        """An `error` event, then response.failed carrying the error."""
        return [self._event("error", code=answer.code or answer.type, message=answer.message, param=answer.param),
                self._event("response.failed", response=self.response("failed", [], error=error_object(answer)))]

    def ending(self, ending: Ending) -> list[bytes]:
        """The message closed, the function calls, then response.completed (or
        response.incomplete) with the whole response."""
        if ending.stats is None:  # cancelled before it ran
            answer = BadRequest("the response was cancelled before it ran", None, 499, code="cancelled")
            return self.failure(answer)
        out = [stream_note(ending.stored)]
        if ending.tail or not ending.calls:
            out += self._delta(ending.tail)
        status, _ = status_of(ending.stats)
        output = []
        if self.message_id is not None:
            text = "".join(self.text)
            item = message_item(self.message_id, text, status)
            output.append(item)
            out += [self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                content_index=0, part=text_part(text)),
                    self._event("response.output_item.done", output_index=0, item=item)]
        for call in ending.calls:
            out += self._call_end(call, output)
        final = self._finish(output, ending.stats, ending.stored, ending.token_ids)
        return out + [self._event(f"response.{final['status']}", response=final)]

    def _call_end(self, call: dict, output: list[dict]) -> list[bytes]:
        """A call's closing events (all of them, where it was not streamed as pieces)."""
        at, item_id = self.streamed.get(call.get("index", -1), (len(output), None))
        item = call_item(call, item_id)
        output.append(item)
        out = [] if item_id else [
            self._event("response.output_item.added", output_index=at,
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                        delta=item["arguments"])]
        return out + [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=item["arguments"]),
                      self._event("response.output_item.done", output_index=at, item=item)]

    # -- whole ----------------------------------------------------------------------------
    def whole(self, reply: Whole) -> dict:
        """The response object: the message (unless the reply is only calls), the calls."""
        status, _ = status_of(reply.stats)
        output = [message_item(new_id("msg"), reply.text, status)] if reply.text or not reply.calls else []
        return self._finish(output + [call_item(c) for c in reply.calls], reply.stats, reply.stored, reply.token_ids)

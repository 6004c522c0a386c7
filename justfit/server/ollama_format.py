"""Ollama's reply shapes for the pump (justfit.server.pump): /api/chat and /api/generate,
streamed as NDJSON (one object a line, the last with `done` and the timings) or whole."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from justfit.engine.events import Progress, Tick
from justfit.server.pump import Ending, Whole
from justfit.server.schema import BadRequest


def now_stamp() -> str:
    """Now, as Ollama's `created_at`."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def timings(stats, start: float) -> dict:
    """The last object's reason and durations (nanoseconds), from `start` (perf_counter)."""
    if stats is None:
        return {"done_reason": "stop"}
    ns = 1_000_000_000
    return {"done_reason": stats.finish_reason or "stop", "total_duration": int((time.perf_counter() - start) * ns),
            "load_duration": 0, "prompt_eval_count": stats.prompt_tokens - stats.cached_tokens,
            "prompt_eval_duration": int(stats.prefill_s * ns), "eval_count": stats.generated_tokens,
            "eval_duration": int(stats.decode_s * ns),
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "forced_tokens": stats.forced_tokens}


class OllamaFormat:
    """One reply of /api/chat (`chat`) or /api/generate (whose last object carries the
    `context`: the prompt's tokens and the reply's)."""

    headers = {"Content-Type": "application/x-ndjson"}
    keepalive, ends_on_failure, reports_state, logprob_entries = False, True, False, False

    def __init__(self, model_id: str, chat: bool, prompt: list[int]):
        self.model_id, self.chat, self.prompt = model_id, chat, prompt
        self.start = time.perf_counter()  # the timings' origin: the request queued

    def _line(self, text: str, done: bool = False, **extra) -> dict:
        out = {"model": self.model_id, "created_at": now_stamp()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        return {**out, "done": done, **extra}

    # -- streamed -------------------------------------------------------------------------
    def opening(self, ahead: int) -> list[bytes]:
        """Nothing: Ollama's stream opens with its first line."""
        return []

    def tick(self, tick: Tick) -> list[bytes]:
        """Nothing: an NDJSON stream has no comments to keep it alive."""
        return []

    def progress(self, progress: Progress) -> list[bytes]:
        """A line with the prompt's progress."""
        info = {"total": progress.total, "processed": progress.processed, "elapsed": round(progress.elapsed, 3)}
        return [_ndjson(self._line("", prompt_progress=info))]

    def token(self, shown: str, entry: dict | None) -> list[bytes]:
        """A line with the text."""
        return [_ndjson(self._line(shown))] if shown else []

    def call_pieces(self, pieces: list) -> list[bytes]:
        """Nothing: Ollama streams a tool call whole, in the final line."""
        return []

    def failure(self, answer: BadRequest) -> list[bytes]:
        """A line with the error's stable message."""
        # A stable message (the scheduler logged the details), never the exception's text.
        return [_ndjson({"error": answer.message})]

    def ending(self, ending: Ending) -> list[bytes]:
        """The held-back text's line, then the final line with timings."""
        final = self._final("", ending.stats, ending.calls, ending.token_ids)
        return [_ndjson(self._line(ending.tail)) if ending.tail else b"", _ndjson(final)]

    # -- whole ----------------------------------------------------------------------------
    def whole(self, reply: Whole) -> dict:
        """The final line as one JSON body."""
        return self._final(reply.text, reply.stats, reply.calls, reply.token_ids)

    def _final(self, text: str, stats, calls: list[dict], token_ids: list[int]) -> dict:
        final = self._line(text, True, **timings(stats, self.start))
        if calls and self.chat:
            final["message"]["tool_calls"] = [
                {"function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in calls]
        if not self.chat:
            final["context"] = self.prompt + token_ids
        return final


def _arguments(text: str) -> dict:
    """A call's arguments as Ollama's object; a call cut short (max tokens) has none."""
    try:
        args = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {"value": args}


def _ndjson(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()

"""Tool calls in generated text: the spans between the tokenizer's tool-call markers
are held back from the visible text and parsed with mlx-lm's tool parser."""

from __future__ import annotations

import json
import uuid


class ToolCalls:
    """Tool-call spans of a generated stream: held back from the visible text, parsed at the end."""

    def __init__(self, tokenizer, tools: list | None):
        on = bool(tools) and getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None
        self.start = tokenizer.tool_call_start if on else None
        self.end = tokenizer.tool_call_end if on else None
        self.parser, self.tools = (tokenizer.tool_parser if on else None), tools
        self._buf, self._inside, self.texts = "", False, []

    def feed(self, text: str) -> str:
        """The part of `text` to show; tool-call spans are collected instead."""
        if self.start is None:
            return text
        self._buf += text
        shown = []
        while True:
            if not self._inside:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.start)  # a marker may be arriving
                    shown.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return "".join(shown)
                shown.append(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(self.start):], True
            j = self._buf.find(self.end) if self.end else -1
            if j < 0:
                return "".join(shown)
            self.texts.append(self._buf[:j])
            self._buf, self._inside = self._buf[j + len(self.end):], False

    def flush(self) -> str:
        """At the end: an unterminated call is still a call; plain text is shown."""
        rest, self._buf = self._buf, ""
        if self._inside and rest.strip():
            self.texts.append(rest)
            return ""
        return rest if not self._inside else ""

    def calls(self, streaming: bool = False) -> list[dict]:
        """The tool calls parsed from the collected spans, in OpenAI's shape (indexed when streaming)."""
        out = []
        for text in self.texts:
            try:
                parsed = self.parser(text.strip(), self.tools)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                continue  # truncated mid-call: nothing callable
            for call in parsed if isinstance(parsed, list) else [parsed]:
                args = call.get("arguments", {})
                item = {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": call.get("name", ""),
                                     "arguments": args if isinstance(args, str) else json.dumps(args)}}
                if streaming:
                    item["index"] = len(out)
                out.append(item)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

"""Tool calls in generated text: the spans between the tokenizer's tool-call markers
are held back from the visible text and parsed with mlx-lm's tool parser (ToolCalls);
a reply constrained to the JSON of its calls (a forced tool_choice) is read as it
arrives, each call streamed as it is generated (JsonCalls). A request's ToolMode
(justfit.server.structured) picks the reader."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


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

    def pieces(self) -> list:
        """Nothing streams before the end: a marked call is parsed whole, once it ended."""
        return []

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


@dataclass(frozen=True)
class ToolMode:
    """How a request's reply may call tools (justfit.server.structured maps each API's
    tool_choice to one). "none": no tools, the text is shown as it is; "auto": the
    template sees `tools` and the calls are parsed out of the model's own tool-call
    markers (ToolCalls); "forced": the reply is constrained to the JSON of the call(s)
    (a list of them when `parallel`), which the server writes as tool calls (JsonCalls)."""

    choice: str = "none"
    tools: list | None = None  # the definitions the chat template shows (OpenAI's form)
    parallel: bool = False  # forced: a JSON array of 1..N calls rather than one call object

    def reader(self, tokenizer):
        """The reader that takes this mode's tool calls out of the generated text."""
        if self.choice == "forced":
            return JsonCalls()
        return ToolCalls(tokenizer, self.tools if self.choice == "auto" else None)


@dataclass(frozen=True)
class CallStart:
    """A streamed tool call begins: its index among the reply's calls, id and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of a streamed tool call's arguments, as JSON text."""

    index: int
    text: str


@dataclass
class _Call:
    id: str
    name: str | None = None
    args_start: int | None = None  # where the arguments' value begins in the text
    args_end: int | None = None  # just past its end, once it ended
    closed: bool = False  # its object ended
    started: bool = False  # its CallStart was handed out
    sent: int = 0  # characters of its arguments handed out


class JsonCalls:
    """A reply that IS the JSON of its tool call(s), `{"name": ..., "arguments": {...}}`
    or an array of those (a forced tool_choice): scanned as it arrives, so each call's
    start and the text of its arguments stream as they are generated (`pieces`); the
    arguments are the generated text itself, so the streamed pieces join into the same
    JSON as the whole reply's. Nothing is shown as text unless no call got a name
    (the reply cut short before one): then the text is."""

    def __init__(self) -> None:
        self.text = ""
        self._pos = 0
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._call_depth = 0  # a call object's depth: 1 (one call) or 2 (in an array)
        self._calls: list[_Call] = []
        self._in_string = self._escape = self._scalar = False
        self._string_at = 0
        self._expect = ""  # in a call object: "key", "value" or "" (after a value)
        self._key: str | None = None  # the call object's key whose value is being read
        self._value_at: int | None = None
        self._pieces: list = []

    def feed(self, text: str) -> str:
        """Nothing to show: the text is the calls' JSON (see `pieces`)."""
        self.text += text
        self._scan()
        return ""

    def flush(self) -> str:
        """The text itself when no call got a name (cut short), else nothing."""
        return "" if any(c.name is not None for c in self._calls) else self.text

    def pieces(self) -> list:
        """The CallStart and CallArguments pieces since the last call."""
        out, self._pieces = self._pieces, []
        return out

    def calls(self, streaming: bool = False) -> list[dict]:
        """Every call that got a name, in OpenAI's shape (indexed when streaming); one
        cut short carries the arguments generated so far."""
        out = []
        for i, call in enumerate(c for c in self._calls if c.name is not None):
            item = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": self._args(call)}}
            if streaming:
                item["index"] = i
            out.append(item)
        return out

    def _args(self, call: _Call) -> str:
        if call.args_start is None:
            return "{}" if call.closed else ""
        return self.text[call.args_start: call.args_end if call.args_end is not None else len(self.text)]

    def _current(self) -> _Call | None:
        return self._calls[-1] if self._calls else None

    def _at_call(self) -> bool:
        """Whether the scan is directly inside a call object."""
        return bool(self._call_depth) and len(self._stack) == self._call_depth and self._stack[-1] == "{"

    def _scan(self) -> None:
        for i in range(self._pos, len(self.text)):
            self._char(i, self.text[i])
        self._pos = len(self.text)
        self._hand_out()

    def _char(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._at_call():
                    self._string_end(i)
            return
        if self._scalar:
            if c not in " \t\r\n,}]":
                return
            self._scalar = False
            self._value_end(i)
        at_call = self._at_call()
        if c == '"':
            self._in_string, self._string_at = True, i
            if at_call and self._expect == "value":
                self._value_start(i)
        elif c in "{[":
            if at_call and self._expect == "value":
                self._value_start(i)
            if not self._stack:
                self._call_depth = 1 if c == "{" else 2
            self._stack.append(c)
            if c == "{" and len(self._stack) == self._call_depth:
                self._calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}"))
                self._expect = "key"
        elif c in "}]":
            if at_call:
                self._current().closed = True
            if self._stack:
                self._stack.pop()
            if self._at_call() and self._value_at is not None:
                self._value_end(i + 1)
        elif at_call and c == ":":
            self._expect = "value"
        elif at_call and c == ",":
            self._expect = "key"
        elif at_call and self._expect == "value" and not c.isspace():
            self._value_start(i)
            self._scalar = True

    def _string_end(self, i: int) -> None:
        if self._expect == "key":
            self._key, self._expect = _json_or_none(self.text[self._string_at: i + 1]), ""
        elif self._value_at is not None:
            self._value_end(i + 1)

    def _value_start(self, i: int) -> None:
        self._value_at, self._expect = i, ""
        if self._key == "arguments":
            self._current().args_start = i

    def _value_end(self, end: int) -> None:
        call, key, start = self._current(), self._key, self._value_at
        self._value_at = self._key = None
        if key == "arguments":
            call.args_end = end
        elif key == "name":
            name = _json_or_none(self.text[start:end])
            call.name = name if isinstance(name, str) else None

    def _hand_out(self) -> None:
        """Pieces for what the scan learned: each named call's start, then its arguments so far."""
        named = [c for c in self._calls if c.name is not None]
        for index, call in enumerate(named):
            if not call.started:
                call.started = True
                self._pieces.append(CallStart(index, call.id, call.name))
            new = self._args(call)[call.sent:]
            if new:
                call.sent += len(new)
                self._pieces.append(CallArguments(index, new))


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None

def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

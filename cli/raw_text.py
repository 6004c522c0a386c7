"""Raw mode for `justfit chat`: no chat template, the conversation is one growing text
that the model continues as typed (what a base model was trained on).

Each input is encoded where it joins the text, and each continuation is kept as the
tokens the model produced, so a turn's prompt starts with exactly the tokens the last
turn computed and the stored state is reused, as with chat messages."""

from __future__ import annotations

from typing import Any


def joined(previous: str | None, text: str, system: str | None = None) -> str:
    """How an input joins the text so far: the first one after the system text (if
    any), later ones on a line of their own."""
    if previous is None:
        return f"{system}\n\n{text}" if system else text
    return text if not previous or previous.endswith("\n") else "\n" + text


def encode(engine: Any, piece: str, first: bool) -> list[int]:
    """A piece of the text as tokens: the first with the model's start token (BOS),
    later ones without."""
    if first:
        return engine.encode(piece)
    return list(engine.tokenizer.encode(piece, add_special_tokens=False))


def text_tokens(engine: Any, messages: list[dict[str, str]], system: str | None = None) -> list[int]:
    """The tokens of a conversation read back from its messages (a loaded transcript):
    inputs joined as typed, each continuation right after its input."""
    tokens: list[int] = []
    previous: str | None = None
    for m in messages:
        piece = joined(previous, m["content"], system) if m["role"] != "assistant" else m["content"]
        if piece:
            tokens += encode(engine, piece, first=not tokens)
        previous = m["content"]
    return tokens


def next_prompt(engine: Any, kept: list[int], previous: str | None, text: str,
                system: str | None = None) -> list[int]:
    """The prompt for a new input `text`: the kept tokens of the text so far (whose
    last message was `previous`), then the input where it joins."""
    return kept + encode(engine, joined(previous, text, system), first=not kept)

"""/save and /load in `justfit chat`: a conversation kept as a named session (state
and transcript, written through after every turn), a state folder, or a transcript
file. A session's name never becomes a path: anything path-like is a file or folder.
These functions do the saving and loading and say what the chat continues with
(`Done`); the chat (cli/chat_session.py) takes it on."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .transcript import parse_transcript


@dataclass(frozen=True)
class Done:
    """What a /save or /load did: `text` for the user; the session the chat's later
    turns are written through to (None: as it was); the conversation it continues
    with, (system prompt, messages) (None: as it was)."""

    text: str
    session: str | None = None
    conversation: tuple[str | None, list[dict[str, str]]] | None = None


def session_name(name: str | Path) -> bool:
    """Whether /save and /load take NAME as a session's name (not a path or .json)."""
    text = str(name)
    return bool(text) and "/" not in text and os.sep not in text and not text.startswith((".", "~")) \
        and not text.endswith(".json")


def save_conversation(engine, transcript: dict, path: str | Path) -> Done:
    """The conversation `transcript` to NAME.json, else the engine's state (with the
    transcript) to the session NAME or the folder NAME."""
    count = len(transcript["messages"])
    if session_name(path):
        info = engine.save_session(str(path), extra={"transcript": transcript})
        return Done(f"saved {count} messages and the state of {info.tokens} tokens as session "
                    f"{path!r}; later turns are saved too", session=str(path))
    if str(path).endswith(".json"):
        text = json.dumps(transcript, indent=2, ensure_ascii=False)
        Path(path).expanduser().write_text(text + "\n", encoding="utf-8")
        return Done(f"saved {count} messages to {path}")
    info = engine.save_state(str(path), extra={"transcript": transcript})
    return Done(f"saved {count} messages and the state of {info.tokens} tokens to {path} "
                f"({info.file_bytes / 2**20:.1f} MiB)")


def load_conversation(engine, path: str | Path) -> Done:
    """Resume a session or a state folder in `engine`, or read a transcript file (the
    engine's kept state left alone: the next turn reuses whatever prefix still matches
    and prefills the rest); ValueError when what it holds is not a transcript."""
    info = engine.resume_session(str(path)) if session_name(path) else None
    if info is not None:
        system, messages, _ = parse_transcript(info.extra.get("transcript"))
        return Done(f"resumed session {path!r}: {len(messages)} messages ({info.tokens} tokens of state)",
                    session=str(path), conversation=(system, messages))
    if Path(path).expanduser().is_dir():
        info = engine.load_state(str(path))
        system, messages, _ = parse_transcript(info.extra.get("transcript"))
        return Done(f"resumed {len(messages)} messages ({info.tokens} tokens of state) from {path}",
                    conversation=(system, messages))
    system, messages, model = parse_transcript(json.loads(Path(path).expanduser().read_text(encoding="utf-8")))
    note = f" (saved with model {model})" if model and model != engine.name else ""
    return Done(f"loaded {len(messages)} messages from {path}{note}", conversation=(system, messages))

"""/save and /load in `justfit chat`: a conversation kept as a named session (state
and transcript, written through after every turn), a state folder, or a transcript
file. A session's name never becomes a path: anything path-like is a file or folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .chat_session import ChatSession


def session_name(name: str | Path) -> bool:
    """Whether /save and /load take NAME as a session's name (not a path or .json)."""
    text = str(name)
    return bool(text) and "/" not in text and os.sep not in text and not text.startswith((".", "~")) \
        and not text.endswith(".json")


def save_conversation(session: ChatSession, path: str | Path) -> str:
    """A transcript to NAME.json, else the engine's state (with the transcript) to
    the folder NAME; returns what was done, for the user."""
    if session_name(path):
        info = session.engine.save_session(str(path), extra={"transcript": session.transcript()})
        session.session = str(path)
        return (f"saved {len(session.messages)} messages and the state of {info.tokens} tokens as session "
                f"{path!r}; later turns are saved too")
    if str(path).endswith(".json"):
        text = json.dumps(session.transcript(), indent=2, ensure_ascii=False)
        Path(path).expanduser().write_text(text + "\n", encoding="utf-8")
        return f"saved {len(session.messages)} messages to {path}"
    info = session.engine.save_state(str(path), extra={"transcript": session.transcript()})
    return (f"saved {len(session.messages)} messages and the state of {info.tokens} tokens to {path} "
            f"({info.file_bytes / 2**20:.1f} MiB)")


def load_conversation(session: ChatSession, path: str | Path) -> str:
    """Resume a session, a state folder or read a transcript; returns what was done."""
    info = session.engine.resume_session(str(path)) if session_name(path) else None
    if info is not None:
        session.apply_transcript(info.extra.get("transcript"))
        session.session = str(path)
        return f"resumed session {path!r}: {len(session.messages)} messages ({info.tokens} tokens of state)"
    if Path(path).expanduser().is_dir():
        before = (session.system, session.messages)
        info = session.engine.load_state(str(path))
        try:
            session.apply_transcript(info.extra.get("transcript"))
        except ValueError:
            session.system, session.messages = before
            raise
        return f"resumed {len(session.messages)} messages ({info.tokens} tokens of state) from {path}"
    model = session.load(path)
    note = f" (saved with model {model})" if model and model != session.engine.name else ""
    return f"loaded {len(session.messages)} messages from {path}{note}"

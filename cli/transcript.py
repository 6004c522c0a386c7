"""Saved `justfit chat` conversations: a transcript is {"model", "system", "messages"}
(or just a list of messages), checked before it replaces a conversation."""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


def parse_transcript(data) -> tuple[str | None, list[dict[str, str]], str | None]:
    """(system prompt, messages, model it was saved with) of a transcript; ValueError
    saying what is wrong when it is not one."""
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError("not a transcript (expected an object with a 'messages' list)")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    messages = []
    for i, m in enumerate(data["messages"]):
        if (not isinstance(m, dict) or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)):
            raise ValueError(f"message {i} needs a role ({', '.join(ROLES)}) and text content")
        if m["role"] == "system" and i == 0 and system is None:
            system = m["content"]
            continue
        messages.append({"role": m["role"], "content": m["content"]})
    model = data.get("model")
    return system, messages, model if isinstance(model, str) else None

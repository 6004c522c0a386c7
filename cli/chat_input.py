"""What `justfit chat` reads: one message per turn, which may span lines (a line
ending in `\\` continues on the next; a \"\"\" line opens a block closed by another)."""

from __future__ import annotations

from typing import Callable

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'


def read_message(read: Callable[[str], str]) -> str:
    """The next message or command from `read(prompt)` (EOFError at the end): a line,
    lines ending in `\\` joined with the next, or a \"\"\" block."""
    line = read(PROMPT)
    stripped = line.strip()
    if stripped.startswith(BLOCK):
        rest = stripped[len(BLOCK):]
        if rest.endswith(BLOCK):  # """one line"""
            return rest[: -len(BLOCK)]
        parts = [rest] if rest else []
        while True:
            try:
                line = read(CONTINUATION)
            except EOFError:
                break
            if line.rstrip().endswith(BLOCK):
                last = line.rstrip()[: -len(BLOCK)]
                if last:
                    parts.append(last)
                break
            parts.append(line)
        return "\n".join(parts)
    if line.endswith("\\"):
        parts = [line[:-1]]
        while True:
            try:
                line = read(CONTINUATION)
            except EOFError:
                break
            if line.endswith("\\"):
                parts.append(line[:-1])
            else:
                parts.append(line)
                break
        return "\n".join(parts)
    return line

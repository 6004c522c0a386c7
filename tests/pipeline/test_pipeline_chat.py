"""`justfit chat --ranks 2` as a user runs it (cli/chat.py, cli/common.py): rank 0 owns the
terminal (a pseudo-terminal as its stdin, the answers typed ahead), the other rank takes
each turn from the pipeline; the group exits 0 on /quit or end of input, with every
reply one process's for greedy decoding. Piped `chat` and `generate` read stdin on rank
0 alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])


def run_cli(args: list[str], ranks: int, stdin: bytes, terminal: bool, timeout: float = 120) -> tuple[int, str, str]:
    """`justfit ARGS --ranks N` with `stdin` piped, or typed ahead on a pseudo-terminal:
    the group's exit status, stdout and stderr."""
    cmd = [sys.executable, "-m", "cli.main", *args, "--ranks", str(ranks)]
    keys, term = os.openpty() if terminal else (None, None)
    try:
        if terminal:
            os.write(keys, stdin)  # typed ahead: the terminal holds the lines until chat reads them
        done = subprocess.run(cmd, stdin=term, input=None if terminal else stdin, capture_output=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT}, timeout=timeout)
    finally:
        for fd in (keys, term) if terminal else ():
            os.close(fd)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def replies(stdout: str) -> list[str]:
    """The replies of an interactive chat whose stdout is not a terminal: each follows
    a prompt (`>>> `); a command's prompt is followed by nothing there."""
    return [r.strip() for r in stdout.split(">>> ")[1:] if r.strip()]


def notices(stderr: str, start: str) -> list[str]:
    """The stderr lines that start with `start`."""
    return [line for line in stderr.splitlines() if line.startswith(start)]


def typed_turns(folder: Path) -> bytes:
    """Two turns, the conversation saved to `folder`, forgotten and restored between
    them, then /stats and /quit."""
    return (f"What is the capital of France?\n/save {folder}\n/reset\n/load {folder}\n"
            f"And of Italy?\n/stats\n/quit\n").encode()


def test_chat_on_two_ranks_answers_two_turns_as_one_process_and_quits(smollm2_gguf, tmp_path):
    """SmolLM2, greedy: the two replies are one process's; the second turn prefills only
    what the state restored on every rank lacks, as one process does, and /stats counts
    the same kept tokens; /quit on rank 0 ends the whole group with status 0."""
    args = ["chat", "-t", "0", "--max-tokens", "12"]
    alone = run_cli(args, 1, typed_turns(tmp_path / "alone"), terminal=True)
    split = run_cli(args, 2, typed_turns(tmp_path / "split"), terminal=True)
    assert alone[0] == 0 and split[0] == 0, (alone[2][-2000:], split[2][-2000:])
    assert "rank 1: layers" in split[2] and "Traceback" not in split[2]
    assert len(replies(alone[1])) == 2, alone[1]
    assert replies(split[1]) == replies(alone[1])
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "split").iterdir()) == ["rank0", "rank1"]
    cached = re.findall(r"\((\d+) cached\)", split[2])  # each turn's stats line, then /stats
    assert cached == re.findall(r"\((\d+) cached\)", alone[2]) and cached[0] == "0" and int(cached[1]) > 0
    kept = notices(split[2], "conversation: 4 messages")
    assert kept and kept == notices(alone[2], "conversation: 4 messages") and " 0 tokens kept" not in kept[0]


@pytest.mark.parametrize("end", [b"\x04", b"/quit\n"], ids=["eof", "quit"])
def test_end_of_input_or_quit_ends_every_rank_cleanly(end, tiny_llama_dir):
    """Ctrl-D (end of input) or /quit after a turn, on a tiny model: every rank exits
    0, the turn's reply is one process's; a named session is refused with the reason."""
    args = ["chat", "--model", str(tiny_llama_dir), "-t", "0", "--max-tokens", "8"]
    alone = run_cli(args, 1, b"hello\n/save talk\n" + end, terminal=True, timeout=60)
    split = run_cli(args, 2, b"hello\n/save talk\n" + end, terminal=True, timeout=60)
    assert alone[0] == 0 and split[0] == 0, (alone[2][-2000:], split[2][-2000:])
    assert len(replies(split[1])) == 1 and replies(split[1]) == replies(alone[1])
    assert "error: cannot save talk: named sessions are kept by one process" in split[2]


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_piped_input_is_read_on_rank_0_alone(command, tiny_llama_dir):
    """Piped `chat` (one question) and `generate` (the text to continue): the follower
    reads no stdin (it had none and failed), the output is one process's."""
    args = [command, "--model", str(tiny_llama_dir), "-t", "0", "--max-tokens", "8"]
    alone = run_cli(args, 1, b"hello there\n", terminal=False, timeout=60)
    split = run_cli(args, 2, b"hello there\n", terminal=False, timeout=60)
    assert alone[0] == 0 and split[0] == 0, (alone[2][-2000:], split[2][-2000:])
    assert alone[1] and split[1] == alone[1]

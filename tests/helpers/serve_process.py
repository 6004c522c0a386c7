"""`justfit serve` as a real process for the stop tests: started on a free port,
streamed named-session turns sent from client threads (each turn's acknowledgement
recorded), and the sessions' stored positions read back from the state directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from statetrans.admin import inventory

ROOT = Path(__file__).resolve().parents[2]
URL = re.compile(r"http://127\.0\.0\.1:(\d+)")


class ServeProcess:
    """`justfit serve --port 0 ARGS...` with its own state directory; `url` once listening."""

    def __init__(self, model: str, state_dir: Path, *args: str, env: dict | None = None, timeout: float = 120):
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", model, "--port", "0",
                                      *args], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "JUSTFIT_STATE_DIR": str(state_dir), **(env or {})})
        self.log: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                m = URL.search(line)
                if m and not self.url and line.startswith("serving"):
                    self.url = f"http://127.0.0.1:{m.group(1)}"
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        end = time.monotonic() + timeout
        while not found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise RuntimeError("justfit serve did not start:\n" + "".join(self.log))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@dataclass
class Turns:
    """One client's streamed turns on its own session: what was acknowledged."""

    name: str
    acked: dict[str, int] = field(default_factory=dict)  # session -> positions after its last acknowledged turn
    not_stored: int = 0  # complete responses that said their state was not stored
    turns: int = 0  # acknowledged turns in all
    history: list[dict] = field(default_factory=list)
    conversations: int = 0

    @property
    def session(self) -> str:
        """The session of the current conversation (a long one moves on to a new session)."""
        return f"{self.name}-{self.conversations}"


def stream_turn(url: str, turns: Turns, max_tokens: int = 6, timeout: float = 30) -> bool:
    """One streamed chat turn on `turns.session`, continuing its history; whether the
    response was complete (its `[DONE]` received). A complete response that says its
    state was stored is an acknowledged turn."""
    messages = turns.history + [{"role": "user", "content": f"turn {len(turns.history) // 2} please go on"}]
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "session": turns.session,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    text, usage, done, stored = [], None, False, True
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith(": x-justfit-state") and "not-stored" in line:
                    stored = False
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    except (OSError, urllib.error.URLError, ValueError):
        return False
    if not done or usage is None:
        return False
    if not stored:
        turns.not_stored += 1
        return True
    # The state holds the prompt and every generated token but the last (sampled, never fed).
    turns.acked[turns.session] = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    turns.turns += 1
    turns.history = messages + [{"role": "assistant", "content": "".join(text)}]
    if len(turns.history) > 16:  # keep prompts short: a new conversation, a new session
        turns.history, turns.conversations = [], turns.conversations + 1
    return True


def keep_turning(url: str, turns: Turns, stop: threading.Event) -> None:
    """Send turns until `stop` or the server goes away."""
    while not stop.is_set():
        if not stream_turn(url, turns):
            return


def stored_positions(state_dir: Path) -> dict[str, int]:
    """Session name -> positions its newest stored generation holds."""
    return {s.session: s.tokens for s in inventory(state_dir) if s.session and s.current and not s.error}


def group_pids(proc: subprocess.Popen) -> list[int]:
    """`proc` and every process below it, now."""
    import psutil

    try:
        p = psutil.Process(proc.pid)
        return [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (zombies count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out

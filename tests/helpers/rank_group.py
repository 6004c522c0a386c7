"""`justfit serve --ranks N` started as a user starts it, for tests of how the group
stops (tests/pipeline/test_rank_lifecycle.py): the top process in a session of its own, as under
a service manager, or (`terminal=True`) with a pseudo-terminal as its controlling
terminal, as in a shell; every process of the group recorded by pid once it serves;
streamed requests read on threads."""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import socket
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import psutil

from justfit.pipeline.launch import free_ports

ROOT = str(Path(__file__).resolve().parents[2])


class ServeGroup:
    """One `justfit serve --ranks N` on a free port; its stderr goes to `log`."""

    def __init__(self, model: Path, log: Path, ranks: int = 2, extra: tuple[str, ...] = (), terminal: bool = False):
        self.port = free_ports(1)[0]
        self.log = log
        self.cmd = [sys.executable, "-m", "cli.main", "serve", "--ranks", str(ranks), "--model", str(model),
                    "--port", str(self.port), *extra]
        self.tty = None
        with open(log, "w") as err:
            if terminal:
                self.tty, follower = os.openpty()
                self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdin=follower, stdout=err, stderr=err,
                                             preexec_fn=_own_terminal)
                os.close(follower)
            else:
                self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                             start_new_session=True)
        self.pids: list[int] = []

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until rank 0 listens; then record the top process and every descendant."""
        end = time.monotonic() + timeout
        while "serving " not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"no server (exit {self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.record()

    def wait_ranks(self, ranks: int = 2, timeout: float = 30.0) -> None:
        """Until the launcher has started its ranks (they are still loading); then record
        them."""
        end = time.monotonic() + timeout
        while len(psutil.Process(self.proc.pid).children()) < ranks:
            assert time.monotonic() < end, self.log.read_text()[-3000:]
            time.sleep(0.01)
        self.record()

    def record(self) -> None:
        """The top process and every descendant, now."""
        top = psutil.Process(self.proc.pid)
        self.pids = [top.pid, *(p.pid for p in top.children(recursive=True))]

    def rank_pids(self) -> list[int]:
        """The ranks' pids, by rank (MLX_RANK in their environment)."""
        ranks = {int(psutil.Process(pid).environ()["MLX_RANK"]): pid for pid in self.pids[1:]}
        return [ranks[r] for r in sorted(ranks)]

    def left(self) -> list[str]:
        """Processes of the group still there: by the pids recorded, and by a command line
        naming this group's port. Zombies (ended, not yet reaped) count as gone."""
        seen = {}
        for pid in self.pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    seen[pid] = " ".join(p.cmdline())
            except psutil.NoSuchProcess:
                pass
        port = str(self.port)
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            cmd = p.info["cmdline"] or []
            if p.info["status"] != psutil.STATUS_ZOMBIE and "cli.main" in cmd and port in cmd:
                seen[p.info["pid"]] = " ".join(cmd)
        return [f"{pid}: {cmd}" for pid, cmd in seen.items()]

    def wait_gone(self, since: float, timeout: float = 30.0) -> float:
        """Seconds from `since` (time.monotonic) until no process of the group is left."""
        end = since + timeout
        while True:
            self.proc.poll()  # reap the top process, a child of this one
            if not self.left():
                took = time.monotonic() - since
                self.proc.wait(10)  # it may have ended between the poll and the look: reap it now
                return took
            if time.monotonic() > end:
                raise AssertionError(f"still there {timeout:g} s on: {self.left()}")
            time.sleep(0.05)

    def port_open(self) -> bool:
        """Whether anything accepts connections on the group's port."""
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def ctrl_c(self) -> None:
        """Type Ctrl-C on the group's terminal (terminal=True)."""
        os.write(self.tty, b"\x03")

    def stream(self, max_tokens: int = 400) -> Stream:
        """A streamed completion, read on a thread."""
        return Stream(self.port, max_tokens)

    def close(self) -> None:
        """Kill whatever is left (a failed test's), by the pids recorded."""
        for line in self.left():
            try:
                os.kill(int(line.split(":")[0]), 9)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.tty is not None:
            os.close(self.tty)


def _own_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is its stdin."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Stream(threading.Thread):
    """POST /v1/completions with stream: the tokens received, and how it ended: "done"
    (finish_reason, then [DONE]), "error" (an error event or status), "cut" (the
    connection closed first)."""

    def __init__(self, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.first = threading.Event()
        self.tokens, self.status, self.ended, self.finish, self.error = 0, 0, "", None, ""
        self.at = 0.0  # when it ended (time.monotonic)
        self.start()

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if resp.status != 200:
                self.error, self.ended = resp.read().decode(errors="replace"), "error"
                return
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.ended = "done" if self.finish else "cut"
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    self.error, self.ended = json.dumps(event["error"]), "error"
                    return
                for choice in event.get("choices", []):
                    self.tokens += 1
                    self.finish = choice.get("finish_reason") or self.finish
                self.first.set()
            self.ended = "cut"
        except (OSError, http.client.HTTPException) as e:
            self.error, self.ended = repr(e), "cut"
        finally:
            self.at = time.monotonic()
            self.first.set()

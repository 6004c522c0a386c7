"""Local ranks of a layer pipeline on this machine (`--ranks N`, the benches): the same
environment `mlx.launch --backend ring` gives each rank (MLX_RANK, MLX_HOSTFILE), with
the ranks writing straight to this process's stdout and stderr.

Why not `mlx.launch` itself: it relays every rank's output through a loop that polls the
ranks' stdin pipes, which are always writable, so it never sleeps: it holds more than a
core while the ranks compute. On two cores that halves a pipeline's speed. Here nothing is relayed: the ranks inherit
the file descriptors, and this process sleeps until a rank ends or a signal comes.

How the group stops. Rank 0 drives the pipeline (in `justfit serve`, the server); the
other ranks follow it, so they must outlive it, and never the launcher:

- A stop signal to the launcher (SIGTERM, SIGHUP, or a SIGINT the terminal did not
  also send to rank 0) is passed to rank 0 alone; rank 0 stops (the server drains) and,
  as it exits, tells the others to leave (the pipeline's STOP). Whatever is left
  `grace` seconds after the first signal is killed.
- Ranks > 0 ignore SIGINT, SIGTERM and SIGHUP: a terminal's Ctrl-C, a service manager
  stopping the whole group (systemd's default) or a hang-up reach every process at
  once, and a follower gone then would fail rank 0's running requests. They leave when
  rank 0 tells them, when rank 0 is gone (their connection from it closes), or killed.
- One rank ending ends the group: once rank 0 has ended, the others get GRACE_S to
  leave if it exited 0 (it told them to), else they are killed; a follower that fails
  gets rank 0 SIGTERM (its requests then fail at once, so its drain is short) and
  `grace` seconds.
- The ranks die with the launcher, however it ends (SIGKILL, a crash): rank 0 then gets
  SIGTERM (it stops as above, its followers gone), the others SIGKILL. On Linux the
  kernel sends these from the fork on (PR_SET_PDEATHSIG); elsewhere a rank that calls
  `watch_launcher` (the CLI does, before loading the model) watches a pipe only the
  launcher holds open: its end of file means the launcher is gone.

Run as `python -m justfit.pipeline.launch -n N [--grace SECONDS] -- CMD...`; it exits with the
first non-zero status of a rank (128 + the signal for a rank killed) or 0.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

GRACE_S = 5.0  # how long the other ranks have to leave once rank 0 has exited 0
AFTER_DRAIN_S = 20.0  # a server's stop after its drain: cancelled requests settle (10 s), state writes flush
DRAIN_S = 10.0  # `justfit serve --drain`'s default, for a launcher not told the drain
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LAUNCHER_PIPE = "JUSTFIT_LAUNCHER_PIPE"  # "FD:INODE": the read end of the pipe the launcher holds


def stop_grace(drain_s: float = DRAIN_S) -> float:
    """Seconds from a stop signal to killing what is left, for a rank 0 that drains for
    `drain_s`."""
    return drain_s + AFTER_DRAIN_S


def launched(ranks: int, cmd: list[str], grace: float | None = None) -> list[str]:
    """`cmd` run as `ranks` local ranks of a layer pipeline (ring backend, loopback);
    `grace`: see run_ranks."""
    extra = [] if grace is None else ["--grace", f"{grace:g}"]
    return [sys.executable, "-m", "justfit.pipeline.launch", "-n", str(ranks), *extra, "--", *cmd]


def free_ports(n: int) -> list[int]:
    """`n` TCP ports on 127.0.0.1 free right now (held together, so all distinct)."""
    with ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def ring_hostfile(ports: list[int], folder: Path) -> Path:
    """The ring backend's hostfile for one rank per port on loopback."""
    path = folder / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def orphan_signal(rank: int) -> int:
    """What a rank gets when its launcher is gone: rank 0 stops (a server drains and
    stores its state), the others, which hold nothing of their own, are killed."""
    return signal.SIGTERM if rank == 0 else signal.SIGKILL


def _prctl():
    """Linux's prctl, else None."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2


def _rank_setup(rank: int, launcher: int):
    """What a rank does between fork and exec (see the module's docstring)."""
    prctl = _prctl()  # here, before the fork

    def setup() -> None:
        if rank > 0:
            for signum in STOP_SIGNALS:  # kept across exec; Python leaves an ignored SIGINT ignored
                signal.signal(signum, signal.SIG_IGN)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, orphan_signal(rank))
            if os.getppid() != launcher:  # it died before the line above
                os._exit(1)
    return setup


def watch_launcher() -> None:
    """In a rank this module started: once the launcher is gone, send this process its
    orphan_signal. A thread waits for the end of file on a pipe only the launcher holds
    open: PR_SET_PDEATHSIG where the kernel has none (nothing to do where it is set)."""
    fd = _launcher_pipe()
    if fd is None or _death_signal() is not None:
        return
    signum = orphan_signal(int(os.environ.get("MLX_RANK", "0")))

    def wait() -> None:
        try:
            while os.read(fd, 64):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait, name="justfit-launcher-watch", daemon=True).start()


def _death_signal() -> int | None:
    """The signal the kernel sends this process when its parent dies, if any (Linux)."""
    import ctypes

    prctl = _prctl()
    got = ctypes.c_int(0)
    if prctl is None or prctl(PR_GET_PDEATHSIG, ctypes.byref(got)) != 0:
        return None
    return got.value or None


def _launcher_pipe() -> int | None:
    """The launcher's pipe, when this process holds it: the environment names its file
    descriptor and inode, so a process that only inherited the environment (a rank's
    own child) does not take another file for it."""
    try:
        fd, inode = (int(v) for v in os.environ.get(LAUNCHER_PIPE, "").split(":"))
        return fd if os.fstat(fd).st_ino == inode else None
    except (ValueError, OSError):
        return None


@contextmanager
def _signal_pipe():
    """The stop signals and SIGCHLD as bytes on a pipe (signal.set_wakeup_fd), so the
    launcher's loop sleeps in one select with a deadline; the handlers do nothing."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    before = {s: signal.signal(s, lambda *_: None) for s in (*STOP_SIGNALS, signal.SIGCHLD)}
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    try:
        yield r
    finally:
        signal.set_wakeup_fd(old_fd)
        for s, handler in before.items():
            signal.signal(s, handler)
        os.close(r)
        os.close(w)


def _terminal_sent(signum: int) -> bool:
    """A SIGINT while this process's group holds its terminal came from the terminal
    (Ctrl-C), which sent it to rank 0 too: a chat goes on, a server stops."""
    if signum != signal.SIGINT:
        return False
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def run_ranks(ranks: int, cmd: list[str], grace: float | None = None) -> int:
    """Start `ranks` ranks of `cmd`, rank 0 with this process's stdin, the others with
    none; wait for all, passing stop signals to rank 0 (see the module's docstring;
    `grace`: seconds from the first to killing what is left, default stop_grace()).
    A rank that fails ends the others; its status is returned."""
    grace = stop_grace() if grace is None else grace
    with tempfile.TemporaryDirectory(prefix="justfit-ranks-") as tmp, _signal_pipe() as wake:
        hostfile = ring_hostfile(free_ports(ranks), Path(tmp))
        watched, held = os.pipe()  # the ranks watch `watched` for its end of file; only this process holds `held`
        try:
            procs = []
            try:
                for rank in range(ranks):
                    env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                               **{LAUNCHER_PIPE: f"{watched}:{os.fstat(watched).st_ino}"})
                    procs.append(subprocess.Popen(cmd, env=env, stdin=None if rank == 0 else subprocess.DEVNULL,
                                                  pass_fds=(watched,), preexec_fn=_rank_setup(rank, os.getpid())))
            except BaseException:
                for p in procs:
                    p.kill()
                    p.wait()
                raise
            finally:
                os.close(watched)
            return _wait(procs, wake, grace)
        finally:
            os.close(held)


def _wait(procs: list[subprocess.Popen], wake: int, grace: float) -> int:
    """Until every rank has ended: act on the signals read from `wake` and on each
    rank's end; returns the launcher's status."""
    rank_of = {p.pid: r for r, p in enumerate(procs)}
    alive = {p.pid: p for p in procs}
    status, deadline = 0, None  # when whatever is left gets SIGKILL

    def by(seconds: float) -> None:
        nonlocal deadline
        end = time.monotonic() + seconds
        deadline = end if deadline is None else min(deadline, end)

    def to_rank0(signum: int) -> None:
        if procs[0].pid in alive:
            os.kill(procs[0].pid, signum)  # not Popen.send_signal: its poll() would reap the rank here

    while alive:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if select.select([wake], [], [], timeout)[0]:
            for signum in os.read(wake, 256):
                if signum in STOP_SIGNALS and not _terminal_sent(signum):
                    to_rank0(signum)
                    by(grace)
        for pid, p in list(alive.items()):
            got, raw = os.waitpid(pid, os.WNOHANG)
            if not got:
                continue
            del alive[pid]
            p.returncode = os.waitstatus_to_exitcode(raw)
            if p.returncode != 0 and status == 0:
                status = p.returncode if p.returncode > 0 else 128 - p.returncode
            if rank_of[pid] == 0:
                # Leaving cleanly, it told the others to leave; else they may wait for it
                # anywhere (still connecting, say), and hold nothing of their own.
                by(GRACE_S if p.returncode == 0 else 0.0)
            elif p.returncode != 0:
                to_rank0(signal.SIGTERM)
                by(grace)
        if alive and deadline is not None and time.monotonic() >= deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            deadline = None  # their ends wake the loop
    return status


def main(argv: list[str]) -> int:
    """`-n N [--grace SECONDS] -- CMD...`."""
    parser = argparse.ArgumentParser(prog="python -m justfit.pipeline.launch",
                                     usage="python -m justfit.pipeline.launch -n N [--grace SECONDS] -- CMD...")
    parser.add_argument("-n", type=int, required=True, help="how many ranks")
    parser.add_argument("--grace", type=float, default=None,
                        help="seconds from a stop signal to killing the ranks left (default: %g)" % stop_grace())
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.print_usage(sys.stderr)
        return 2
    split = argv.index("--")
    try:
        args = parser.parse_args(argv[:split])
    except SystemExit as e:
        return int(e.code or 0)
    if args.n < 1 or (args.grace is not None and args.grace < 0):
        parser.print_usage(sys.stderr)
        return 2
    return run_ranks(args.n, argv[split + 1:], args.grace)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

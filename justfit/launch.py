"""Local ranks of a layer pipeline on this machine (`--ranks N`, the benches): the same
environment `mlx.launch --backend ring` gives each rank (MLX_RANK, MLX_HOSTFILE), with
the ranks writing straight to this process's stdout and stderr.

Why not `mlx.launch` itself: it relays every rank's output through a loop that polls the
ranks' stdin pipes, which are always writable, so it never sleeps: it holds more than a
core while the ranks compute (measured here: 114% of a core beside two idle ranks).
On two cores that halves a pipeline's speed. Here nothing is relayed: the ranks inherit
the file descriptors, and this process blocks in `wait` until they end.

Run as `python -m justfit.launch -n N -- CMD...`; it exits with the first non-zero
status of a rank (the others are then ended) or 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

GRACE_S = 5.0  # how long a rank has to leave after SIGTERM before SIGKILL


def launched(ranks: int, cmd: list[str]) -> list[str]:
    """`cmd` run as `ranks` local ranks of a layer pipeline (ring backend, loopback)."""
    return [sys.executable, "-m", "justfit.launch", "-n", str(ranks), "--", *cmd]


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


def _die_with_parent() -> None:
    """In a rank, before exec: end when the launcher does (Linux), so a launcher killed
    by a timeout leaves no rank behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_ranks(ranks: int, cmd: list[str]) -> int:
    """Start `ranks` ranks of `cmd`, rank 0 with this process's stdin, the others with
    none; wait for all. A rank that fails ends the others; its status is returned."""
    with tempfile.TemporaryDirectory(prefix="justfit-ranks-") as tmp:
        hostfile = ring_hostfile(free_ports(ranks), Path(tmp))
        procs = []
        for rank in range(ranks):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            procs.append(subprocess.Popen(cmd, env=env, stdin=None if rank == 0 else subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None))

        def forward(signum, _frame):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, forward)
        status = 0
        running = {p.pid: p for p in procs}
        while running:
            try:
                pid, raw = os.wait()
            except InterruptedError:
                continue
            except KeyboardInterrupt:  # the ranks got the terminal's SIGINT too
                continue
            p = running.pop(pid, None)
            if p is None:
                continue
            p.returncode = os.waitstatus_to_exitcode(raw)
            if p.returncode != 0:
                status = p.returncode if p.returncode > 0 else 128 - p.returncode
                _end(list(running.values()))  # reaps them
                running.clear()
        return status


def _end(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL for any rank still there after GRACE_S."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str]) -> int:
    """`-n N -- CMD...`."""
    if len(argv) < 4 or argv[0] != "-n" or argv[2] != "--" or not argv[1].isdigit() or int(argv[1]) < 1:
        print("usage: python -m justfit.launch -n N -- CMD...", file=sys.stderr)
        return 2
    return run_ranks(int(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

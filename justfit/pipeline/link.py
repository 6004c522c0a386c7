"""Transfers between neighbouring ranks of a layer pipeline that wait asleep.

MLX's ring backend waits for data by spinning: a rank waiting on its neighbour holds a
core at 100% for as long as it waits. Ranks on one machine share
its cores, so the waiting rank slows the one computing; on any machine an idle follower
would hold a core between requests. So each rank also opens one plain TCP connection to
the next rank of the ring, a doorbell: a sender rings it (one byte) once its data is
computed, and the receiver sleeps in `recv` on it until then. MLX then carries the data,
which by then is on its way. Without a ring hostfile (another backend) a `Link` sends and
receives through MLX alone.

Every transfer here is evaluated at once: a pipeline's transfers are its synchronization
points anyway, and a ring must be paired with exactly one message.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

CONNECT_S = 60.0  # how long the ranks may take to reach each other at start-up


@dataclass
class Link:
    """A rank's transfers to the next rank and from the previous one (see the module)."""

    group: object  # mx.distributed.Group
    out: socket.socket | None = None  # doorbell to the next rank
    inp: socket.socket | None = None  # doorbell from the previous rank

    def rank(self) -> int:
        """This process's rank."""
        return self.group.rank()

    def size(self) -> int:
        """How many ranks."""
        return self.group.size()

    def send(self, x: mx.array, peer: int) -> mx.array:
        """Compute `x`, then send it to `peer` (the next rank)."""
        mx.eval(x)
        if self.out is not None:
            self._check(peer, +1)
            self.out.sendall(b"\x01")
        sent = mx.distributed.send(x, peer, group=self.group)
        mx.eval(sent)
        return sent

    def recv_like(self, like: mx.array, peer: int) -> mx.array:
        """An array shaped like `like` from `peer` (the previous rank), asleep until it
        comes. A closed doorbell (the peer is gone) raises ConnectionError."""
        if self.inp is not None:
            self._check(peer, -1)
            if not self.inp.recv(1):
                raise ConnectionError(f"rank {peer} of the pipeline closed its connection")
        got = mx.distributed.recv_like(like, peer, group=self.group)
        mx.eval(got)
        return got

    def _check(self, peer: int, step: int) -> None:
        if peer != (self.rank() + step) % self.size():
            raise ValueError(f"rank {self.rank()} transfers only with its ring neighbours, not rank {peer}")


def ring_addresses(path: str | None) -> list[str] | None:
    """Each rank's IP from a ring hostfile (MLX_HOSTFILE: a JSON list, per rank, of
    "ip:port"), or None where there is none to read."""
    try:
        hosts = json.loads(Path(path).read_text(encoding="utf-8")) if path else None
        return [h[0].rsplit(":", 1)[0] for h in hosts] if hosts else None
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return None


def connect(group) -> Link:
    """This rank's Link over `group`: the doorbells to the next and from the previous
    rank, at the ring hostfile's addresses (MLX_HOSTFILE); every rank calls it, and the
    listening ports are exchanged over `group`."""
    ips = ring_addresses(os.environ.get("MLX_HOSTFILE"))
    usable = ips is not None and len(ips) == group.size()
    listener = None
    port = -1
    if usable:
        listener = socket.create_server((ips[group.rank()], 0))
        port = listener.getsockname()[1]
    ports = mx.distributed.all_gather(mx.array([port], dtype=mx.int64), group=group).tolist()
    if min(ports) < 0:  # some rank has no ring hostfile: MLX alone, on every rank
        if listener is not None:
            listener.close()
        return Link(group)
    rank, size = group.rank(), group.size()
    with listener:
        listener.settimeout(CONNECT_S)
        nxt = (rank + 1) % size
        out = socket.create_connection((ips[nxt], ports[nxt]), timeout=CONNECT_S)
        inp, _ = listener.accept()
    for s in (out, inp):
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Link(group, out, inp)

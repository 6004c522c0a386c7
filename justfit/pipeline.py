"""Layers pipelined across the ranks of an `mx.distributed` group (issue 21): each rank
holds only its share of the decoder layers; rank 0 also holds the embedding, the final
norm's consumer and the head, and drives every forward pass.

The model code stays mlx-lm's. On each rank the layers it does not hold are replaced by
parameter-free stand-ins, so one unmodified `model.model(...)` call runs the rank's
share between two transfers:

- rank 0: its own layers, then at the first layer it does not hold an `Exchange` that
  sends the hidden state on (after a header saying how many positions follow) and
  receives the final, normed hidden state back; the rest pass through, and its norm is
  the identity (the last rank applied the real one);
- rank r > 0: a `Receive` in place of layer 0 takes the hidden state from rank r - 1;
  after its last layer a `Forward` sends it to rank r + 1, or, on the last rank, its
  norm sends the normed state back to rank 0.

Ranks other than 0 run `follow`, a loop that waits for rank 0's headers. Positions
advance on every rank's stand-in caches so masks and offsets agree with rank 0's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

FORWARD, RESET, STOP = 1, 2, 3  # header ops rank 0 sends


@dataclass(frozen=True)
class Split:
    """Which layers each rank holds: rank r holds [starts[r], starts[r + 1])."""

    starts: tuple[int, ...]  # len(ranks) + 1 entries, the last one the layer count

    @property
    def size(self) -> int:
        return len(self.starts) - 1

    def layers(self, rank: int) -> range:
        return range(self.starts[rank], self.starts[rank + 1])


def split_layers(layers: int, budgets: list[int], fixed: int = 0, per_layer: int = 1) -> Split:
    """Layers in proportion to each rank's budget, after rank 0's `fixed` bytes (embedding
    and head) come off its share; every rank holds at least one layer."""
    if len(budgets) > layers:
        raise ValueError(f"{len(budgets)} ranks for {layers} layers: each rank needs at least one")
    room = [max(0, b - (fixed if r == 0 else 0)) for r, b in enumerate(budgets)]
    total = sum(room) or len(room)
    counts = [max(1, round(layers * r / total)) for r in room]
    while sum(counts) > layers:  # rounding: take from the largest share, never below one
        counts[counts.index(max(counts))] -= 1
    while sum(counts) < layers:
        counts[room.index(max(room))] += 1
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return Split(tuple(starts))


class Position(KVCache):
    """A layer this rank does not hold: no keys or values, only the offset every cache
    of the sequence shares (masks are made from it)."""

    def advance(self, n: int) -> None:
        self.offset += n

    @property
    def state(self) -> list:
        return []

    @state.setter
    def state(self, v) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0


class WindowPosition(RotatingKVCache):
    """A sliding-window layer this rank does not hold: a one-value-wide shadow of its
    rotating cache, so the masks made from it (offset, rotation) match the real one's."""

    def advance(self, n: int) -> None:
        dummy = mx.zeros((1, 1, n, 1), dtype=mx.float16)
        self.update_and_fetch(dummy, dummy)


def shadow(cache) -> KVCache:
    """The stand-in for a layer whose own cache would be `cache`."""
    if isinstance(cache, RotatingKVCache):
        return WindowPosition(max_size=cache.max_size, keep=cache.keep)
    return Position()


class _StandIn(nn.Module):
    """A layer held elsewhere: advances its position cache; subclasses move the state."""

    def __call__(self, x: mx.array, mask=None, cache=None, **_) -> mx.array:
        if isinstance(cache, (Position, WindowPosition)):
            cache.advance(x.shape[1])
        return self.move(x)

    def move(self, x: mx.array) -> mx.array:
        return x


class Exchange(_StandIn):
    """Rank 0: send the header and the hidden state on; receive the normed state back."""

    def __init__(self, group, last: int):
        super().__init__()
        self._group, self._last = group, last

    def move(self, x: mx.array) -> mx.array:
        header = mx.distributed.send(mx.array([FORWARD, x.shape[1]], dtype=mx.int32), 1, group=self._group)
        sent = mx.distributed.send(mx.depends(x, header), 1, group=self._group)
        back = mx.distributed.recv_like(x, self._last, group=self._group)
        return mx.depends(back, sent)


class Receive(_StandIn):
    """Rank r > 0, in place of layer 0: the hidden state from rank r - 1."""

    def __init__(self, group, source: int):
        super().__init__()
        self._group, self._source = group, source

    def move(self, x: mx.array) -> mx.array:
        return mx.distributed.recv_like(x, self._source, group=self._group)


class Forward(_StandIn):
    """Rank 0 < r < last, after its last layer: the hidden state to rank r + 1."""

    def __init__(self, group, dest: int):
        super().__init__()
        self._group, self._dest = group, dest

    def move(self, x: mx.array) -> mx.array:
        return mx.distributed.send(x, self._dest, group=self._group)


class SendBack(nn.Module):
    """The last rank's final norm: normalize, then send the result to rank 0."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.norm, self._group = norm, group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.send(self.norm(x), 0, group=self._group)


class Identity(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return x


def keep_share(model: nn.Module, split: Split, group) -> None:
    """Replace, in place, what this rank does not hold by stand-ins (their weights are
    let go): see the module's docstring."""
    rank, size = group.rank(), group.size()
    body = model.model
    mine = split.layers(rank)
    for i, layer in enumerate(body.layers):
        if i in mine:
            continue
        if rank == 0 and i == mine.stop:
            stand_in = Exchange(group, size - 1)
        elif rank > 0 and i == 0:
            stand_in = Receive(group, rank - 1)
        elif 0 < rank < size - 1 and i == mine.stop:
            stand_in = Forward(group, rank + 1)
        else:
            stand_in = _StandIn()
        # the model's loop reads plain facts off each layer (e.g. `use_sliding` for its mask)
        for key, value in vars(layer).items():
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None))):
                setattr(stand_in, key, value)
        body.layers[i] = stand_in
    if rank == 0:
        body.norm = Identity()
    elif rank == size - 1:
        body.norm = SendBack(body.norm, group)


def make_cache(model: nn.Module, full: list) -> list:
    """This rank's caches from `full`, the caches the whole model would use: its own
    layers' as they are, a shadow for each stand-in."""
    return [shadow(c) if isinstance(layer, _StandIn) else c for layer, c in zip(model.model.layers, full)]


def control(group, op: int) -> None:
    """Rank 0: tell the other ranks (down the chain) to reset their caches (RESET) or to
    leave (STOP)."""
    mx.eval(mx.distributed.send(mx.array([op, 0], dtype=mx.int32), 1, group=group))


def held_layers(model: nn.Module):
    """This rank's own layers."""
    return (layer for layer in model.model.layers if not isinstance(layer, _StandIn))


def follow(model: nn.Module, group, new_cache, hidden: int, dtype=mx.float32, limit: int = 0) -> None:
    """Rank r > 0: run this rank's share for each header from rank 0 (the previous rank
    forwards rank 0's header on) until STOP (or, for tests, `limit` forwards)."""
    rank, size = group.rank(), group.size()
    cache = new_cache()
    header_like = mx.zeros((2,), dtype=mx.int32)
    forwards = 0
    while not limit or forwards < limit:
        op, n = (int(v) for v in mx.distributed.recv_like(header_like, rank - 1, group=group).tolist())
        if rank < size - 1:  # pass the header down the chain
            mx.eval(mx.distributed.send(mx.array([op, n], dtype=mx.int32), rank + 1, group=group))
        if op == STOP:
            return
        if op == RESET:
            cache = new_cache()
            continue
        out = model.model(None, cache=cache, input_embeddings=mx.zeros((1, n, hidden), dtype=dtype))
        mx.eval(out, [c.state for c in cache])
        forwards += 1

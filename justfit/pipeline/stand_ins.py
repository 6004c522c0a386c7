"""The parts of a model a pipeline rank does not hold (justfit.pipeline.layers): stand-in
layers that pass the hidden state between ranks, and shadow caches that keep their
positions so masks and offsets agree with rank 0's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, create_attention_mask

FORWARD, RESET, STOP = 1, 2, 3  # header ops rank 0 sends


class Position:
    """A layer this rank does not hold: no keys or values, only the offset every cache
    of the sequence shares (masks are made from it, as mlx-lm's KVCache makes them).
    Not a KVCache, so the planner and KVExec count and page only the layers held."""

    def __init__(self):
        self.offset = 0

    def advance(self, n: int) -> None:
        """Move on by `n` positions."""
        self.offset += n

    def make_mask(self, *args, **kwargs):
        """The mask a KVCache at this offset would make."""
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def is_trimmable(self) -> bool:
        """Positions can be dropped (the offset only)."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` positions; how many were."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> list:
        """Arrays to evaluate with the cache: none (the transfers ran when made)."""
        return []

    nbytes = 0


class WindowPosition(Position):
    """A sliding-window layer this rank does not hold: a one-value-wide shadow of its
    rotating cache, so the masks made from it (offset, rotation) match the real one's."""

    def __init__(self, max_size: int, keep: int = 0):
        super().__init__()
        self._ring = RotatingKVCache(max_size=max_size, keep=keep)

    def advance(self, n: int) -> None:
        """Move on by `n` positions, rotating as the real cache would."""
        dummy = mx.zeros((1, 1, n, 1), dtype=mx.float16)
        self._ring.update_and_fetch(dummy, dummy)
        self.offset = self._ring.offset

    def make_mask(self, *args, **kwargs):
        """The mask the real rotating cache would make."""
        return self._ring.make_mask(*args, **kwargs)

    def is_trimmable(self) -> bool:
        """A rotating cache cannot drop positions."""
        return False

    @property
    def state(self) -> list:
        """The shadow ring's arrays."""
        return [a for a in (self._ring.keys, self._ring.values) if a is not None]

    @property
    def place(self) -> tuple[int, list[int]]:
        """Where the shadow ring is, for a snapshot: its length, and its offset, keep,
        max_size and write index. Read through mlx-lm's public `state`, which in the
        pinned range (mlx-lm 0.32) carries the arrays and those four numbers."""
        keys, _, *numbers = self._ring.state
        return (0 if keys is None else keys.shape[2]), [int(n) for n in numbers]

    def restore(self, size: int, numbers: list[int]) -> None:
        """Put the shadow ring where `place` said (`size` placeholder positions: only
        their count matters to the masks)."""
        dummy = mx.zeros((1, 1, size, 1), dtype=mx.float16) if size else None
        self._ring.state = (dummy, dummy, *numbers)
        self.offset = self._ring.offset


def shadow(cache) -> Position:
    """The stand-in for a layer whose own cache would be `cache`."""
    if isinstance(cache, RotatingKVCache):
        return WindowPosition(cache.max_size, cache.keep)
    return Position()


class _StandIn(nn.Module):
    """A layer held elsewhere: advances its position cache; subclasses move the state."""

    def __call__(self, x: mx.array, mask=None, cache=None, **_) -> mx.array:
        if isinstance(cache, Position):
            cache.advance(x.shape[1])
        return self.move(x)

    def move(self, x: mx.array) -> mx.array:
        """The hidden state this stand-in passes on."""
        return x


class Exchange(_StandIn):
    """Rank 0: send the header and the hidden state on; receive the normed state back."""

    def __init__(self, link, last: int):
        super().__init__()
        self._link, self._last = link, last

    def move(self, x: mx.array) -> mx.array:
        """Header and state on to rank 1; the final state back from the last rank."""
        mx.eval(x)  # this rank's layers first, so the header comes when the state is ready
        self._link.send(mx.array([FORWARD, x.shape[1]], dtype=mx.int32), 1)
        self._link.send(x, 1)
        return self._link.recv_like(x, self._last)


class Pass(_StandIn):
    """Rank r > 0: in place of layer 0, the hidden state received from rank r - 1
    (`sending` False); on a middle rank, after its last layer, the state sent to rank
    r + 1 (`sending` True)."""

    def __init__(self, link, peer: int, sending: bool):
        super().__init__()
        self._link, self._peer, self._sending = link, peer, sending

    def move(self, x: mx.array) -> mx.array:
        """The state sent on, or the state received."""
        if self._sending:
            return self._link.send(x, self._peer)
        return self._link.recv_like(x, self._peer)


class SendBack(nn.Module):
    """The last rank's final norm: normalize, then send the result to rank 0."""

    def __init__(self, norm: nn.Module, link):
        super().__init__()
        self.norm, self._link = norm, link

    def __call__(self, x: mx.array) -> mx.array:
        return self._link.send(self.norm(x), 0)


def keep_share(model: nn.Module, mine: range, link) -> None:
    """Replace, in place, what this rank does not hold by stand-ins (their weights are
    let go) that transfer over `link` (justfit.pipeline.link.Link): see the module's docstring."""
    rank, size = link.rank(), link.size()
    body = model.model
    for i, layer in enumerate(body.layers):
        if i in mine:
            continue
        if rank == 0 and i == mine.stop:
            stand_in = Exchange(link, size - 1)
        elif rank > 0 and i == 0:
            stand_in = Pass(link, rank - 1, sending=False)
        elif 0 < rank < size - 1 and i == mine.stop:
            stand_in = Pass(link, rank + 1, sending=True)
        else:
            stand_in = _StandIn()
        # the model's loop reads plain facts off each layer (e.g. `use_sliding` for its mask)
        for key, value in vars(layer).items():
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None))):
                setattr(stand_in, key, value)
        body.layers[i] = stand_in
    if rank == 0:
        body.norm = nn.Identity()  # the last rank applied the real one
    elif rank == size - 1:
        body.norm = SendBack(body.norm, link)


def make_cache(model: nn.Module, full: list) -> list:
    """This rank's caches from `full`, the caches the whole model would use: its own
    layers' as they are, a shadow for each stand-in."""
    return [shadow(c) if isinstance(layer, _StandIn) else c for layer, c in zip(model.model.layers, full)]


def held_layers(model: nn.Module):
    """This rank's own layers."""
    return (layer for layer in model.model.layers if not isinstance(layer, _StandIn))



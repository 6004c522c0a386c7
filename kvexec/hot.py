"""A page store's hot window: the newest tokens in full precision, in preallocated room.

A decode step writes its token in place (MLX updates a buffer nothing else holds
without copying it) instead of concatenating it onto the window, which copied the whole
window, up to 2 x 511 x kv_heads x head_dim floats, per layer per step. Readers get a
view of exactly the tokens held; `keys_room`/`values_room` are the buffers themselves
(native decode attention reads their first `n` tokens).
"""

from __future__ import annotations

import mlx.core as mx


class HotWindow:
    """Up to `room` tokens [B, kv_heads, n, D] of keys and values without reallocating
    (more when one append brings more)."""

    def __init__(self, room: int):
        self.room = max(1, room)
        self.keys_room: mx.array | None = None
        self.values_room: mx.array | None = None
        self.n = 0

    def keys(self) -> mx.array | None:
        """The held keys (a view of exactly n tokens), or None when none were ever held."""
        return None if self.keys_room is None else self.keys_room[..., : self.n, :]

    def values(self) -> mx.array | None:
        """The held values (a view of exactly n tokens), or None."""
        return None if self.values_room is None else self.values_room[..., : self.n, :]

    def set(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Hold exactly `keys` and `values` (None: nothing), as arrays of their own: a
        trim's slices of the old room would keep the whole room alive, uncounted."""
        own = lambda a: None if a is None else mx.contiguous(a)  # noqa: E731
        self.keys_room, self.values_room = own(keys), own(values)
        self.n = 0 if keys is None else keys.shape[-2]

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add tokens after the held ones."""
        L = keys.shape[-2]
        room = self.keys_room
        if room is None or self.n + L > room.shape[-2] or room.dtype != keys.dtype or room.shape[:2] != keys.shape[:2]:
            self._move(0, keys, values, self.n + L)
        self.keys_room[..., self.n : self.n + L, :] = keys
        self.values_room[..., self.n : self.n + L, :] = values
        self.n += L

    def drop_oldest(self, count: int) -> None:
        """Forget the oldest `count` tokens (they went into a page)."""
        if count >= self.n:
            self.n = 0
            return
        self._move(count, self.keys_room, self.values_room, self.n - count)

    def _move(self, skip: int, like_k: mx.array, like_v: mx.array, need: int) -> None:
        """New room for `need` tokens (doubling up to `room`), holding the held tokens from `skip` on."""
        capacity = max(need, min(self.room, 2 * need))
        keep = self.n - skip
        new = []
        for old, like in ((self.keys_room, like_k), (self.values_room, like_v)):
            buf = mx.zeros((*like.shape[:2], capacity, like.shape[-1]), dtype=like.dtype)
            if keep > 0:
                buf[..., :keep, :] = old[..., skip : self.n, :].astype(like.dtype)
            new.append(buf)
        self.keys_room, self.values_room = new
        self.n = keep

"""A page store's hot window: the newest tokens in full precision, in preallocated room.

A decode step writes its token in place (MLX updates a buffer nothing else holds
without copying it) instead of concatenating it onto the window, which copied the whole
window, up to 2 x 511 x kv_heads x head_dim floats, per layer per step. Readers get a
view of exactly the tokens held; `keys_room`/`values_room` are the buffers themselves
(native decode attention reads their first `n` tokens).

The room may start with a copy of other tokens, the `lead` (the store's sinks, where MLX
computes attention): a decode step then reads sinks and window as one block, one
product and no softmax pieces to join for both (kvexec.store `blocks`). The window's
tokens follow it; `keys()`/`values()` never include it.
"""

from __future__ import annotations

import mlx.core as mx


class HotWindow:
    """Up to `room` tokens [B, kv_heads, n, D] of keys and values without reallocating
    (more when one append brings more), after the `lead` tokens copied in front."""

    def __init__(self, room: int):
        self.room = max(1, room)
        self.keys_room: mx.array | None = None
        self.values_room: mx.array | None = None
        self.n = 0
        self.lead = 0  # tokens in front of the window's in the room (a copy of lead_k, lead_v)
        self.lead_k: mx.array | None = None
        self.lead_v: mx.array | None = None

    def keys(self) -> mx.array | None:
        """The held keys (a view of exactly n tokens), or None when none were ever held."""
        return None if self.keys_room is None else self.keys_room[..., self.lead : self.lead + self.n, :]

    def values(self) -> mx.array | None:
        """The held values (a view of exactly n tokens), or None."""
        return None if self.values_room is None else self.values_room[..., self.lead : self.lead + self.n, :]

    def set(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Hold exactly `keys` and `values` (None: nothing), as arrays of their own: a
        trim's slices of the old room would keep the whole room alive, uncounted. The
        lead stays in front where there are keys; with none it goes too."""
        if keys is None or values is None or not self.lead:
            own = lambda a: None if a is None else mx.contiguous(a)  # noqa: E731
            self.keys_room, self.values_room = own(keys), own(values)
            self.lead, self.lead_k, self.lead_v = 0, None, None
        else:
            self.keys_room = mx.concatenate([self.lead_k.astype(keys.dtype), keys], axis=-2)
            self.values_room = mx.concatenate([self.lead_v.astype(values.dtype), values], axis=-2)
        self.n = 0 if keys is None else keys.shape[-2]

    def set_lead(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Copy `keys` and `values` (None: none) in front of the window's tokens, which stay."""
        room = self.keys_room
        old = self.lead
        self.lead = 0 if keys is None else keys.shape[-2]
        self.lead_k, self.lead_v = keys, values
        if room is not None:
            self._move(0, room, self.values_room, self.n, room.shape[-2] - old, old)

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add tokens after the held ones."""
        L = keys.shape[-2]
        room = self.keys_room
        at = self.lead + self.n
        if room is None or at + L > room.shape[-2] or room.dtype != keys.dtype or room.shape[:2] != keys.shape[:2]:
            self._move(0, keys, values, self.n + L)
            at = self.lead + self.n
        self.keys_room[..., at : at + L, :] = keys
        self.values_room[..., at : at + L, :] = values
        self.n += L

    def drop_oldest(self, count: int) -> None:
        """Forget the oldest `count` tokens (they went into a page)."""
        if count >= self.n:
            self.n = 0
            return
        self._move(count, self.keys_room, self.values_room, self.n - count)

    def _move(self, skip: int, like_k: mx.array, like_v: mx.array, need: int, capacity: int | None = None,
              old_lead: int | None = None) -> None:
        """New room for `need` tokens (doubling up to `room`; or `capacity`) after the
        lead, holding the held tokens from `skip` on (the old room's lead: `old_lead`)."""
        capacity = max(need, min(self.room, 2 * need)) if capacity is None else max(need, capacity)
        old_lead = self.lead if old_lead is None else old_lead
        keep = self.n - skip
        new = []
        for old, like, lead in ((self.keys_room, like_k, self.lead_k), (self.values_room, like_v, self.lead_v)):
            buf = mx.zeros((*like.shape[:2], self.lead + capacity, like.shape[-1]), dtype=like.dtype)
            if self.lead:
                buf[..., : self.lead, :] = lead.astype(like.dtype)
            if keep > 0:
                buf[..., self.lead : self.lead + keep, :] = old[..., old_lead + skip : old_lead + self.n, :].astype(like.dtype)
            new.append(buf)
        self.keys_room, self.values_room = new
        self.n = keep

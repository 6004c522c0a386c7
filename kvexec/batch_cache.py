"""Several sequences' paged caches as one cache for a batched forward.

A batched decode step runs the model once on B rows (one new token per sequence):
the projections and MLP read each weight once for the whole batch. Attention cannot
share: every sequence has its own pages (length, formats, retention). `BatchLayerCache`
stands in for one layer's cache: it splits the new keys and values by row into each
sequence's store, gives RoPE each row's own position, and runs the executor per
sequence when the seam calls `attend`.
"""

from __future__ import annotations

import mlx.core as mx

from kvexec.cache import KVPlaceholder, PagedKVCache, placeholders


class BatchLayerCache(PagedKVCache):
    """One layer of B sequences' caches, row i of the batch being `members[i]`."""

    def __init__(self, members: list[PagedKVCache]):  # no store of its own: the members hold the pages
        if not members or not all(isinstance(m, PagedKVCache) for m in members):
            raise TypeError("a batched layer cache is made of paged KV caches (one per sequence)")
        self.members = members

    @property
    def offset(self) -> mx.array | int:
        """Each row's position (RoPE takes a per-row offset array), or the shared one."""
        offsets = [m.offset for m in self.members]
        if len(set(offsets)) == 1:
            return offsets[0]
        return mx.array(offsets)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KVPlaceholder, KVPlaceholder]:
        """Store row i's new keys and values in sequence i's pages."""
        if keys.shape[0] != len(self.members):
            raise ValueError(f"{keys.shape[0]} rows for a batch of {len(self.members)} sequences")
        for i, member in enumerate(self.members):
            member.store.append(keys[i:i + 1], values[i:i + 1])
        return placeholders(keys, values, max(m.offset for m in self.members))

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """Row i's attention over sequence i's own pages (lengths and formats differ)."""
        rows = [m.attend(queries[i:i + 1], scale, sinks) for i, m in enumerate(self.members)]
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)

    @property
    def state(self) -> list[mx.array]:
        """Every member's arrays (to evaluate them after a step)."""
        return [a for m in self.members for a in m.state]

    @state.setter
    def state(self, value) -> None:
        """Refused: the members hold the state."""
        raise TypeError("a batched layer cache has no state of its own: its members do")

    def can_trim(self, n: int) -> bool:
        """Never: each sequence trims its own cache."""
        return False

    def trim(self, n: int) -> int:
        """Refused: trim each sequence's own cache."""
        raise TypeError("trim each sequence's own cache, not the batch")

    def size(self) -> int:
        """The longest member's length."""
        return max(m.offset for m in self.members)

    def empty(self) -> bool:
        """Whether no member holds anything yet."""
        return all(m.empty() for m in self.members)

    @property
    def nbytes(self) -> int:
        """Bytes every member holds."""
        return sum(m.nbytes for m in self.members)


def batch_caches(caches: list[list]) -> list[BatchLayerCache]:
    """Per layer, the B sequences' caches as one (`caches[i]` is sequence i's cache list).
    Raises TypeError when a layer is not paged (recurrent state cannot be split by row here)."""
    layers = {len(c) for c in caches}
    if len(layers) != 1:
        raise ValueError("the sequences' cache lists differ in length (not one model)")
    return [BatchLayerCache([c[layer] for c in caches]) for layer in range(layers.pop())]

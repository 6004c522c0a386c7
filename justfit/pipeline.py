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
- rank r > 0: a `Pass` in place of layer 0 takes the hidden state from rank r - 1;
  after its last layer another `Pass` sends it to rank r + 1, or, on the last rank, its
  norm sends the normed state back to rank 0.

Ranks other than 0 run `follow`, a loop that waits for rank 0's headers. Positions
advance on every rank's stand-in caches so masks and offsets agree with rank 0's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from justfit.stand_ins import FORWARD, RESET, STOP, held_layers, keep_share, make_cache

__all__ = ["FORWARD", "RESET", "STOP", "Pipeline", "Split", "attach", "control", "follow", "held_layers",
           "keep_share", "make_cache", "split_layers", "head_bytes"]

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


@dataclass(frozen=True)
class Pipeline:
    """This process's place in a layer pipeline."""

    group: object  # mx.distributed.Group
    split: Split

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def head_bytes(model: nn.Module) -> int:
    """What rank 0 holds besides its layers: the embedding and an untied head."""
    from mlx.utils import tree_flatten

    parts = [model.model.embed_tokens] + ([model.lm_head] if isinstance(getattr(model, "lm_head", None), nn.Module)
                                          else [])
    return sum(v.nbytes for p in parts for _, v in tree_flatten(p.parameters()))


def attach(model: nn.Module, group, budget: int | None, hidden: int) -> Pipeline:
    """Make `model` this rank's share of a pipeline over `group`: layers split in
    proportion to every rank's budget (gathered from all of them; None counts as
    equal), what it does not hold replaced by stand-ins, and, on ranks > 0, the
    embedding by a one-row stub (only rank 0 embeds and runs the head). Its
    `make_cache` then gives shadows for the stand-ins."""
    mine = mx.array([budget if budget is not None else -1], dtype=mx.int64)
    budgets = [int(b) for b in mx.distributed.all_gather(mine, group=group).tolist()]
    if any(b < 0 for b in budgets):
        budgets = [1] * len(budgets)
    split = split_layers(len(model.model.layers), budgets, head_bytes(model))
    full = _cache_maker(model)
    keep_share(model, split.layers(group.rank()), group)
    if group.rank() > 0:
        body = model.model
        dtype = _float_dtype(body.embed_tokens)
        body.embed_tokens = nn.Embedding(1, hidden)
        body.embed_tokens.weight = body.embed_tokens.weight.astype(dtype)
    model.make_cache = lambda: make_cache(model, full())  # read by mlx-lm's make_prompt_cache
    return Pipeline(group, split)


def _cache_maker(model: nn.Module):
    """The model's own cache factory, as mlx-lm's make_prompt_cache would use it."""
    if hasattr(model, "make_cache"):
        return model.make_cache
    layers = len(model.layers)
    return lambda: [KVCache() for _ in range(layers)]


def _float_dtype(module: nn.Module):
    for name in ("scales", "weight"):
        a = getattr(module, name, None)
        if a is not None and mx.issubdtype(a.dtype, mx.floating):
            return a.dtype
    return mx.float32


def control(group, op: int) -> None:
    """Rank 0: tell the other ranks (down the chain) to reset their caches (RESET) or to
    leave (STOP)."""
    mx.eval(mx.distributed.send(mx.array([op, 0], dtype=mx.int32), 1, group=group))


def follow(model: nn.Module, group, new_cache, hidden: int, dtype=mx.float32, limit: int = 0,
           phase=None) -> None:
    """Rank r > 0: run this rank's share for each header from rank 0 (the previous rank
    forwards rank 0's header on) until STOP (or, for tests, `limit` forwards); `phase`
    (PhaseSwap.phase) wraps each forward, "prefill" for several positions."""
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
        with phase("prefill" if n > 1 else "decode") if phase else contextlib.nullcontext():
            out = model.model(None, cache=cache, input_embeddings=mx.zeros((1, n, hidden), dtype=dtype))
            mx.eval(out, [c.state for c in cache])
        forwards += 1

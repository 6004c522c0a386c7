"""Layers pipelined across the ranks of an `mx.distributed` group: each rank
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

from justfit.pipeline.link import connect
from justfit.pipeline.stand_ins import FORWARD, RESET, STOP, held_layers, keep_share, make_cache

__all__ = ["FORWARD", "RESET", "STOP", "Pipeline", "Split", "attach", "connect", "control", "follow", "held_layers",
           "keep_share", "make_cache", "split_layers", "head_bytes", "layer_facts",
           "plan_split", "rank_footprint", "resume", "gather"]


@dataclass(frozen=True)
class Split:
    """Which layers each rank holds: rank r holds [starts[r], starts[r + 1])."""

    starts: tuple[int, ...]  # len(ranks) + 1 entries, the last one the layer count

    @property
    def size(self) -> int:
        """How many ranks."""
        return len(self.starts) - 1

    def layers(self, rank: int) -> range:
        """The layers `rank` holds."""
        return range(self.starts[rank], self.starts[rank + 1])


def plan_split(base, kinds: list[int | None], layer_bytes: list[int], head: int, budgets: list[int]) -> Split:
    """The contiguous split whose smallest rank holds the most positions, each rank's
    footprint planned from its own layers alone: `kinds[i]` None for a layer whose KV
    grows, its window for a sliding one; `layer_bytes[i]` its weights; `head` what
    rank 0 holds besides (embedding, head); `base` the planner's Footprint of the whole
    model for everything else (chunk, page format, transient). Falls back to
    `split_layers` when no split holds a position."""
    n, ranks = len(kinds), len(budgets)
    if ranks > n:
        raise ValueError(f"{ranks} ranks for {n} layers: each rank needs at least one")

    def need(lo: int, hi: int, rank: int, positions: int) -> int:
        return rank_footprint(base, kinds, layer_bytes, head if rank == 0 else 0, range(lo, hi)).at(positions).total

    def greedy(positions: int) -> tuple[int, ...] | None:
        """Each rank in turn takes as many layers as its budget holds at `positions`
        (optimal for contiguous shares: a share's need only grows with its layers)."""
        starts, lo = [0], 0
        for r, budget in enumerate(budgets):
            last = n if r == ranks - 1 else n - (ranks - 1 - r)
            hi = lo
            while hi < last and need(lo, hi + 1, r, positions) <= budget:
                hi += 1
            if hi == lo or (r == ranks - 1 and hi < n):
                return None
            starts.append(hi)
            lo = hi
        return tuple(starts)

    if greedy(1) is None:
        return split_layers(n, budgets, head)
    lo, hi = 1, 2
    while greedy(hi) is not None and hi < 1 << 30:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if greedy(mid) is not None else (lo, mid)
    return Split(greedy(lo))


def rank_footprint(base, kinds: list[int | None], layer_bytes: list[int], head: int, layers: range):
    """The planner's footprint (`base`, the whole model's) of a rank holding `layers`
    (kinds and bytes as in `plan_split`) and `head` bytes besides."""
    from dataclasses import replace

    shape = replace(base.shape, weights=sum(layer_bytes[i] for i in layers) + head,
                    full_layers=sum(kinds[i] is None for i in layers),
                    windows=tuple(kinds[i] for i in layers if kinds[i] is not None))
    return replace(base, shape=shape).at(1)


def split_layers(layers: int, budgets: list[int], fixed: int = 0) -> Split:
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


class PipelineRun:
    """What rank 0 of a layer pipeline keeps between requests: `live`, the state every
    rank still holds ((tokens, cache, sampler), or None), and `lost`, why the pipeline
    stopped once a rank is gone ("" while it runs; requests are refused from then on)."""

    def __init__(self):
        self.live: tuple | None = None
        self.lost = ""


@dataclass(frozen=True)
class Pipeline:
    """This process's place in a layer pipeline."""

    split: Split
    link: object  # justfit.pipeline.link.Link: the transfers to and from this rank's neighbours

    @property
    def group(self):
        """The mx.distributed.Group (the link's)."""
        return self.link.group

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.group.rank()

    @property
    def size(self) -> int:
        """How many ranks."""
        return self.group.size()


def gather(group, value: int) -> list[int]:
    """Every rank's `value`, in rank order (each rank calls it with its own): budgets,
    or the positions each rank's plan holds, so rank 0 refuses before any work."""
    got = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group)
    return [int(v) for v in got.tolist()]


def head_bytes(model: nn.Module) -> int:
    """What rank 0 holds besides its layers: the embedding and an untied head."""
    from mlx.utils import tree_flatten

    parts = [model.model.embed_tokens] + ([model.lm_head] if isinstance(getattr(model, "lm_head", None), nn.Module)
                                          else [])
    return sum(v.nbytes for p in parts for _, v in tree_flatten(p.parameters()))


def layer_facts(model: nn.Module) -> tuple[list[int | None], list[int]]:
    """Per layer: None where its KV grows, else its window (0: a constant state), and
    its weights' bytes as loaded (lazily: no weight is read)."""
    from mlx.utils import tree_flatten

    kinds = []
    for c in _cache_maker(model)():
        kinds.append(None if type(c) is KVCache else getattr(c, "max_size", 0) or 0)
    sizes = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.model.layers]
    return kinds, sizes


def attach(model: nn.Module, group, budget: int | None, hidden: int, base=None) -> Pipeline:
    """Make `model` this rank's share of a pipeline over `group`: layers split so the
    smallest rank holds the most positions (every rank's budget gathered; `base`, the
    planner's footprint of the whole model; without budgets or base, evenly), what it
    does not hold replaced by stand-ins, and, on ranks > 0, the
    embedding by a one-row stub (only rank 0 embeds and runs the head). Its
    `make_cache` then gives shadows for the stand-ins."""
    budgets = gather(group, budget if budget is not None else -1)
    if min(budgets) < 0:  # a rank without a budget: an even split
        split = split_layers(len(model.model.layers), [1] * len(budgets))
    elif base is None:
        split = split_layers(len(model.model.layers), budgets, head_bytes(model))
    else:
        split = plan_split(base, *layer_facts(model), head_bytes(model), budgets)
    full = _cache_maker(model)
    link = connect(group)
    keep_share(model, split.layers(group.rank()), link)
    if group.rank() > 0:
        body = model.model
        dtype = _float_dtype(body.embed_tokens)
        body.embed_tokens = nn.Embedding(1, hidden)
        body.embed_tokens.weight = body.embed_tokens.weight.astype(dtype)
    model.make_cache = lambda: make_cache(model, full())  # read by mlx-lm's make_prompt_cache
    return Pipeline(split, link)


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


def control(link, op: int) -> None:
    """Rank 0: tell the other ranks (down the chain) to reset their caches (RESET) or to
    leave (STOP)."""
    link.send(mx.array([op, 0], dtype=mx.int32), 1)


def resume(link, live, tokens: list[int]):
    """Rank 0, a request starting: the state every rank still holds from the last request
    (`live`: its tokens, rank 0's cache and sampler state) where those tokens begin this
    request's and leave one to compute (each rank extends its own share as it is); else
    every rank starts afresh (RESET). A statetrans.Reuse either way."""
    from statetrans import Reuse

    if live is not None:
        held, cache, sampler = live
        if len(held) < len(tokens) and tokens[:len(held)] == held:
            return Reuse(cache, list(held), dict(sampler), "memory")
    control(link, RESET)
    return Reuse(None, [], {}, "")


def follow(model: nn.Module, link, new_cache, hidden: int, dtype=mx.float32, limit: int = 0,
           phase=None, on_state=None) -> None:
    """Rank r > 0: run this rank's share for each header from rank 0 (the previous rank
    forwards rank 0's header on) until STOP (or, for tests, `limit` forwards); `phase`
    (PhaseSwap.phase) wraps each forward, "prefill" for several positions; `on_state(op,
    payload, cache)` carries out a state operation (justfit.pipeline.state) and returns
    the cache to go on with."""
    from justfit.pipeline.state import STATE_OPS, receive

    rank, size = link.rank(), link.size()
    cache = new_cache()
    header_like = mx.zeros((2,), dtype=mx.int32)
    forwards = 0
    with contextlib.ExitStack() as phases:
        # A phase lasts while the forwards stay of its kind, as on rank 0 (a request's
        # prefill chunks, then its decode steps): entering one per forward would set up
        # its weight forms every token.
        kind = None
        while not limit or forwards < limit:
            op, n = (int(v) for v in link.recv_like(header_like, rank - 1).tolist())
            if rank < size - 1:  # pass the header down the chain
                link.send(mx.array([op, n], dtype=mx.int32), rank + 1)
            if op == STOP:
                return
            if op == RESET:
                cache = new_cache()
                continue
            if op in STATE_OPS:
                cache = on_state(op, receive(link, n), cache)
                continue
            wanted = "prefill" if n > 1 else "decode"
            if phase and wanted != kind:
                phases.close()
                phases.enter_context(phase(wanted))
                kind = wanted
            out = model.model(None, cache=cache, input_embeddings=mx.zeros((1, n, hidden), dtype=dtype))
            mx.eval(out, [c.state for c in cache])
            forwards += 1

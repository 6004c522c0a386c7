"""What a request will need in memory, before it runs.

A first-order model: resident weights + the largest working copy a PhaseSwap lease adds
(one linear materialized dense, a streamed layer read from disk) + KV bytes per retained
position (pages in their format, the hot window and sinks in full precision;
sliding-window layers stop at their window) + the largest transient of one prefill
chunk or decode step: attention's (kvexec.attention.transient_bytes; scores over the
whole context with mlx-lm's own cache), MLP activations, and the last position's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from justfit.memory import tree_bytes, weight_bytes
from kvexec import KVConfig, ladder, page_bytes_per_token, transient_bytes
from kvexec.disk_pages import PageReader
from kvexec.segments import allocated_positions

# The reserve before any request has measured one (`Reserve`): allocator slack and small
# temporaries the terms below do not model, as a share of them plus a floor that matters
# only for tiny models (masks, RoPE tables, small arrays).
RESERVE = 0.02
RESERVE_FLOOR = 1 << 18
# Of the budget, what the pressure ladder leaves unused (see Footprint.page_allowance).
PAGE_MARGIN = 0.04
# The smallest prefill chunk a tight budget may ask for: SmolLM2 prefill runs as fast at
# 128 tokens per chunk as at 512; at 64 its activations (64 x 576 x 4 B, 147 KB) fall
# below glibc's mmap threshold (256 KiB under a budget) and fragment the heap, which
# costs more outside MLX at the peak than the smaller transient saves.
MIN_PREFILL_CHUNK = 128


@dataclass(frozen=True)
class Reserve:
    """What a footprint keeps back beyond its terms (weights, working copy, KV,
    transient): `share` of them plus `floor` bytes. Before any request the prior
    (RESERVE, RESERVE_FLOOR); under a budget, once requests ran, the measured share by
    which MLX's peak exceeded the terms predicted at each request's own length and chunk
    (justfit.planning.budget.Budget.remeasure_reserve), no floor."""

    share: float = RESERVE
    floor: int = RESERVE_FLOOR
    measured: bool = False
    requests: int = 0  # requests measured (0: the prior)

    def __post_init__(self) -> None:
        if self.share < 0 or self.floor < 0:
            raise ValueError(f"a reserve is never below zero: share {self.share}, floor {self.floor}")

    def bytes(self, terms: int) -> int:
        """The reserve for a footprint whose terms sum to `terms` bytes."""
        return int(self.share * terms) + self.floor

    def describe(self) -> str:
        """Where it comes from, for the footprint's text."""
        if self.measured:
            return (f"measured: {100 * self.share:.2f}% of the terms, MLX's peak over the prediction "
                    f"in recent requests ({self.requests} measured)")
        return f"prior: {100 * self.share:g}% of the terms + {self.floor >> 10} KiB, none measured yet"


PRIOR_RESERVE = Reserve()


@dataclass(frozen=True)
class _Shape:
    weights: int
    working: int
    full_layers: int  # layers whose KV grows with every position
    windows: tuple[int, ...]  # window size of each sliding layer
    state_bytes: int  # constant per-sequence state (recurrent layers)
    kv_row: int  # bytes of K+V for one position in one layer, full precision (as sinks and the hot window keep it)
    page_row: float  # the same in the page format (== kv_row without KVExec)
    window_row: float  # page_row of a sliding layer (per-layer formats may differ by kind)
    top_row: float  # == page_row, or under pressure the page format's (the segment being filled)
    full_tokens: int  # positions per layer held in full precision (sinks, hot window + chunk)
    rest_tokens: int  # the same between requests (sinks and the hot window)
    page_tokens: int
    block_tokens: int | None  # KVExec: keys per attention block; None: whole context
    retain: int | None  # KVExec retention: positions kept per layer
    heads: int
    kv_heads: int
    head_dim: int
    observed: bool  # KVExec retention scores attention mass (the executor's unfolded path)
    hidden: int
    intermediate: int
    vocab: int
    chunk: int
    act_bytes: int
    dense_prefill: bool = True  # prefill on dense working copies (`working`), else on the resident forms
    row_invariant: bool = False  # a prefill chunk's rows attend as lone queries (justfit.engine.numerics)
    # Pages held to a limit (the engine's budget): segments give back unwritten room before
    # any page steps down (kvexec.segments.release_unwritten), so pages count whole, not
    # whole segments.
    limited: bool = False
    # Growing layers whose pages live on disk (kvexec.disk_pages): in memory, each keeps
    # its segment being filled; two such layers' pages are read back at a time.
    disk_layers: int = 0
    page_row_max: float = 0.0  # the largest layer's page_row (what one read buffer holds)
    verify_rows: int = 1  # the most positions one decode step feeds (speculative decoding's verify)
    reserve: Reserve = PRIOR_RESERVE  # kept back beyond the terms (the prior, or the budget's measured one)

    @property
    def bytes_per_position(self) -> float:
        """Page bytes one more position adds over every attention layer (before a window fills)."""
        return self.page_row * self.full_layers + self.window_row * len(self.windows)


@dataclass(frozen=True)
class Footprint:
    """A request's predicted memory by kind, in bytes, at `positions` retained positions."""

    positions: int
    weights: int
    working: int
    kv: int
    transient: int
    shape: _Shape
    pages: int = 0  # page bytes of the layers whose KV grows, once prefill is done (KVExec)
    disk: int = 0  # page bytes on disk (kvexec.disk_pages): what decode reads per token
    read_slots: int = 0  # of `kv`, the disk reader's two slots (kvexec.disk_pages.PageReader)

    @property
    def total(self) -> int:
        """Every kind together, the reserve included."""
        return self.terms + self.reserve

    @property
    def terms(self) -> int:
        """The predicted kinds without the reserve: what a request's MLX peak is measured against."""
        return self.weights + self.working + self.kv + self.transient

    @property
    def reserve(self) -> int:
        """What is kept back for the allocator and the transients the terms leave out
        (`shape.reserve`: the prior, or measured under a budget)."""
        return self.shape.reserve.bytes(self.terms)

    @property
    def disk_segments(self) -> int:
        """Segments on disk: the page index's entries (one extent each)."""
        s = self.shape
        return 0 if not self.disk or s.block_tokens is None else round(self.disk / (s.block_tokens * s.page_row))

    def at(self, positions: int) -> Footprint:
        """The same request's footprint at `positions` retained positions."""
        return _estimate(self.shape, positions)

    def max_positions(self, budget: int) -> int:
        """Largest position count whose footprint fits `budget` (0 if none), with the
        pages held to the budget's limit (`_Shape.limited`)."""
        shape = replace(self.shape, limited=True)
        lo, hi = 0, 1
        while _estimate(shape, hi).total <= budget and hi < 1 << 30:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _estimate(shape, mid).total <= budget else (lo, mid)
        return lo

    def page_allowance(self, budget: int) -> int:
        """The most bytes the growing layers' pages may take with the total within
        `budget`: this footprint's pages plus what the budget leaves over, less
        PAGE_MARGIN of it. Pages given the whole slack would put the request at the
        budget's edge, where the first-order terms above err by a few MiB; the margin
        costs only how many pages stay in the wider formats, not capacity."""
        return self.pages + int(max(0, budget * (1 - PAGE_MARGIN) - self.total) / (1 + self.shape.reserve.share))

    def as_dict(self) -> dict[str, int | bool | str]:
        """The figures by name, for JSON (`reserve_from`: the reserve measured or the prior, in words)."""
        return {"positions": self.positions, "weights": self.weights, "working": self.working, "kv": self.kv,
                "transient": self.transient, "reserve": self.reserve, "total": self.total,
                "disk_layers": self.shape.disk_layers, "disk": self.disk,
                "reserve_measured": self.shape.reserve.measured, "reserve_from": self.shape.reserve.describe()}


def _layer_kv(s: _Shape, held: int, full_tokens: int | None = None, sliding: bool = False) -> tuple[float, float]:
    """(full-precision bytes, page bytes) of one layer holding `held` positions, of
    which up to `full_tokens` (default: during prefill) in full precision; `sliding`: a
    sliding-window layer (its own page row; its ring's pages never step down)."""
    full = min(held, s.full_tokens if full_tokens is None else full_tokens)
    paged = held - full
    if s.block_tokens is not None and paged:  # segments are allocated ahead of use
        paged = allocated_positions(paged, s.page_tokens, s.block_tokens, s.limited and not sliding)
    if sliding:
        return full * s.kv_row, paged * s.window_row
    tail = min(paged, s.block_tokens or 0)  # the segment being filled keeps the page format
    return full * s.kv_row, paged * s.page_row + tail * (s.top_row - s.page_row)


def _disk_split(s: _Shape, held: int, chunk: int) -> tuple[float, float]:
    """(page bytes a disk layer keeps in memory, page bytes it has on disk) at `held`
    positions: in memory, the segment being filled, and with chunks longer than a page
    the one it filled too (spilled once attention has read it)."""
    paged = max(0, held - s.rest_tokens)
    if s.block_tokens is None or not paged:
        return 0.0, 0.0
    allocated = allocated_positions(paged, s.page_tokens, s.block_tokens)
    resident = min(allocated, s.block_tokens * (2 if chunk > s.page_tokens else 1))
    return resident * s.page_row, (allocated - resident) * s.page_row


def _estimate(s: _Shape, positions: int) -> Footprint:
    chunk = min(s.chunk, max(positions, 1))
    held = positions if s.retain is None else min(positions, s.retain)
    hot, pages = _layer_kv(s, held)
    resident_layers = s.full_layers - s.disk_layers
    kv = resident_layers * (hot + pages)
    disk = buffer = 0.0
    if s.disk_layers:
        in_memory, disk_per_layer = _disk_split(s, held, chunk)
        disk = s.disk_layers * disk_per_layer
        # the layer computing and the one read, each in a slot with room to grow (kvexec.disk_pages)
        buffer = 2 * PageReader.SLACK * disk_per_layer * s.page_row_max / s.page_row
        kv += s.disk_layers * (hot + in_memory) + buffer
    if s.block_tokens is not None:  # the exact trim point's full-precision copies (kvexec.exact): at most a hot window
        kv += (s.full_layers + len(s.windows)) * min(held, s.rest_tokens + s.page_tokens) * s.kv_row
    # Once prefill ends, the chunk and a page's worth of the hot window are pages too:
    # fewer bytes in all, but more of them in pages (what a page limit must allow).
    rest = _layer_kv(s, held, s.rest_tokens)[1]
    # A sliding layer holds its window plus at most one chunk, one page and the hot window.
    kv += sum(sum(_layer_kv(s, min(positions, w + chunk + s.full_tokens), sliding=True)) for w in s.windows)
    if s.block_tokens is None:  # mlx-lm's cache: scores and their exponentials over the whole context
        attention = chunk * s.heads * positions * 4 * 2
    else:  # KVExec: its prefill chunk's or a decode step's, whichever holds more
        attention = max(transient_bytes(chunk, positions, s.heads, s.kv_heads, s.head_dim, s.block_tokens,
                                        s.observed, row_invariant=s.row_invariant),
                        transient_bytes(s.verify_rows, positions, s.heads, s.kv_heads, s.head_dim, s.block_tokens,
                                        s.observed))
    rows = max(chunk, s.verify_rows)
    mlp = rows * s.intermediate * 3 * s.act_bytes
    hidden = rows * s.hidden * 4 * s.act_bytes
    # The last prompt position's logits, or a verify step's: every row's, in float32 and
    # the activations' width.
    logits = s.vocab * (4 if s.verify_rows == 1 else s.verify_rows * (4 + s.act_bytes))
    transient = attention + mlp + hidden + logits
    return Footprint(positions, s.weights, s.working, int(kv) + s.state_bytes, int(transient), s,
                     int(resident_layers * rest), int(disk), int(buffer))


def _arg_reader(model: nn.Module, config: dict):
    args = getattr(model, "args", None)
    cfg = config.get("text_config", config)

    def arg(name: str, default=None):
        return getattr(args, name, None) or cfg.get(name, default)

    return arg


def attention_shape(model: nn.Module, config: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) from the model's args or its config."""
    arg = _arg_reader(model, config)
    heads = arg("num_attention_heads")
    return heads, arg("num_key_value_heads", heads), arg("head_dim") or arg("hidden_size") // heads


def cache_layout(model: nn.Module) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """The model's caches as mlx-lm makes them: how many attention layers hold every
    position, each sliding layer's window, the sliding layers' indices among the attention
    layers, and the bytes of every other cache's state (recurrent layers)."""
    full, windows, window_layers, state = 0, [], [], 0
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            window_layers.append(full + len(windows))  # its index among the attention layers
            windows.append(c.max_size)
        elif isinstance(c, KVCache):
            full += 1
        else:
            state += tree_bytes(getattr(c, "state", []))
    return full, tuple(windows), tuple(window_layers), state


def footprint(model: nn.Module, config: dict, positions: int, chunk: int = 512,
              kv: KVConfig | None = None, weights: int | None = None, working: int = 0,
              act_bytes: int | None = None, pressed: bool = False, dense_prefill: bool = True,
              limited: bool = False, disk_layers: int = 0, verify_rows: int = 1,
              row_invariant: bool = False, reserve: Reserve = PRIOR_RESERVE) -> Footprint:
    """What `positions` retained positions need; `kv` None means mlx-lm's own cache.
    `weights` defaults to every parameter the model holds; `working` is PhaseSwap's
    largest lease; `act_bytes` the activation width (4 for fp32 compute); `pressed`:
    pages stepped down to the last format of KVExec's pressure ladder; `dense_prefill`
    False: prefill runs on the resident forms (the plan carries it; `working` then
    counts no dense copy); `limited`: a budget holds the pages to a limit (whole pages
    counted, not whole segments); `disk_layers`: growing layers whose pages live on disk;
    `verify_rows`: the most positions a decode step feeds (1 + a draft's tokens,
    justfit.engine.draft), each with its logits; `row_invariant`: a prefill chunk's
    rows attend as lone queries (`--deterministic`, kvexec.attention.invariant_rows);
    `reserve`: what is kept back beyond the terms (`Reserve`; the engine's budget measures it)."""
    arg = _arg_reader(model, config)
    hidden = arg("hidden_size")
    heads, kv_heads, head_dim = attention_shape(model, config)
    act_bytes = act_bytes or (4 if _is_fp32(model) else 2)
    full, windows, window_layers, state = cache_layout(model)
    return layers_footprint(positions, full_layers=full, windows=windows, state_bytes=state, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                            intermediate=arg("intermediate_size", 4 * hidden), vocab=arg("vocab_size", 32000),
                            weights=weight_bytes(model) if weights is None else weights, working=working,
                            chunk=chunk, kv=kv, act_bytes=act_bytes, pressed=pressed,
                            window_layers=window_layers, dense_prefill=dense_prefill, limited=limited,
                            disk_layers=disk_layers, verify_rows=verify_rows, row_invariant=row_invariant,
                            reserve=reserve)


def layers_footprint(positions: int, *, full_layers: int, windows: tuple[int, ...], state_bytes: int, heads: int,
                     kv_heads: int, head_dim: int, hidden: int, intermediate: int, vocab: int, weights: int,
                     working: int, chunk: int, kv: KVConfig | None, act_bytes: int,
                     pressed: bool = False, window_layers: tuple[int, ...] = (),
                     dense_prefill: bool = True, limited: bool = False, disk_layers: int = 0,
                     verify_rows: int = 1, row_invariant: bool = False,
                     reserve: Reserve = PRIOR_RESERVE) -> Footprint:
    """`footprint` from layer counts and sizes alone, no model: what `justfit fit
    --config` plans a model with before its weights are downloaded. `window_layers`:
    the attention-layer indices of the sliding layers, where `kv` has per-layer formats
    (calibration gives the two kinds different ones: a window's bytes do not grow)."""
    kv_row = 2 * kv_heads * head_dim * (act_bytes if kv is None else kv.full_bytes(act_bytes))
    if kv is None:
        page_row, full_tokens, block, retain, page = kv_row, 0, None, None, 1
        rest_tokens = 0
        top_row = window_row = row_max = page_row
    else:
        full, sliding = None, None  # every layer's formats, unless they split by kind
        if kv.layer_formats and window_layers and len(kv.layer_formats) == full_layers + len(windows):
            sliding = window_layers
            full = tuple(sorted(set(range(len(kv.layer_formats))) - set(window_layers)))
        top_row = page_bytes_per_token(kv, kv_heads, head_dim, full)
        window_row = page_bytes_per_token(kv, kv_heads, head_dim, sliding)
        page_row = _pressed_row(kv, kv_heads, head_dim, full) if pressed else top_row
        growing = range(len(kv.layer_formats)) if full is None else full
        row_max = max([page_bytes_per_token(kv, kv_heads, head_dim, (i,)) for i in growing] if kv.layer_formats
                      else [top_row])
        # The hot window's buffer also holds the last chunk appended until the next one.
        full_tokens = kv.sink_tokens + kv.hot_window + kv.page_size + chunk
        rest_tokens = kv.sink_tokens + kv.hot_window
        block, page = kv.block_tokens, kv.page_size
        retain = kv.max_positions
    shape = _Shape(
        weights=weights, working=working, full_layers=full_layers, windows=tuple(windows), state_bytes=state_bytes,
        kv_row=kv_row, page_row=page_row, window_row=window_row, top_row=top_row, full_tokens=full_tokens, rest_tokens=rest_tokens, page_tokens=page, block_tokens=block, retain=retain,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        observed=kv is not None and kv.max_positions is not None and kv.policy == "score", hidden=hidden,
        intermediate=intermediate, vocab=vocab,
        chunk=chunk, act_bytes=act_bytes, dense_prefill=dense_prefill, limited=limited,
        disk_layers=0 if kv is None else min(disk_layers, full_layers), page_row_max=row_max,
        verify_rows=max(1, verify_rows), row_invariant=row_invariant, reserve=reserve,
    )
    return _estimate(shape, positions)


def _pressed_row(kv: KVConfig, kv_heads: int, head_dim: int, layers=None) -> float:
    """Page bytes per position per layer (of `layers`; None: all) once every page has
    stepped down its layer's ladder (each layer's ladder starts at its own format in a
    calibrated config)."""
    last = tuple(ladder(replace(kv, format=f, layer_formats=()), head_dim)[-1].name
                 for f in kv.layer_formats or (kv.format,))
    return page_bytes_per_token(replace(kv, format=last[0], layer_formats=last if kv.layer_formats else ()),
                                kv_heads, head_dim, layers)


def _is_fp32(model: nn.Module) -> bool:
    emb = getattr(getattr(model, "model", model), "embed_tokens", None)
    weight = getattr(emb, "scales", None) if hasattr(emb, "scales") else getattr(emb, "weight", None)
    return weight is not None and weight.dtype == mx.float32

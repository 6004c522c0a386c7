"""One attention layer's KV, kept as pages.

Layout by position: pinned sink tokens (full precision) | pages of `page_size` tokens
in the page format | a full-precision hot window of the most recent tokens. When the
hot window holds `hot_window + page_size` tokens, its oldest `page_size` become a
page, written in place into a preallocated segment (never copied, never reallocated;
segment sizes double from one page up to `block_tokens`); a segment is also one
attention block. Sliding-window layers
drop segments that no future query can see, so their store is a bounded ring.

Under a page byte limit (the engine sets one from its budget), pages step down a
ladder of smaller formats (`KVConfig.pressure`) before a new segment would pass it:
the oldest segment of the widest format first, so every page steps down once before
any steps twice, and the segment being filled stays in the page format. Under the
limit a new segment is only as large as fits beside the pages, and neighbours that
end up full and in one format coalesce again, up to a block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx

from kvexec.attention import Block
from kvexec.formats import KVFormat, get_format


@dataclass(frozen=True)
class KVConfig:
    # q8c: the most compact format with no measurable loss on SmolLM2 and Gemma 3, and
    # the fastest to decode on CPU (bench/quality.py, bench/kv.py; README's KVExec part).
    format: str = "q8c"
    page_size: int = 256
    hot_window: int = 256  # most recent tokens kept in full precision
    sink_tokens: int = 4  # first tokens kept in full precision (global layers)
    block_tokens: int = 2048  # tokens decoded per attention block: bounds the transient
    max_positions: int | None = None  # retention: positions kept per layer (None: all)
    policy: str = "score"  # what retention evicts first: "score" (least attended) or "random"
    select_pages: int | None = None  # decode attends to the top-k pages by key bound (Quest)
    pin_prompt: bool = True  # retention keeps every prompt position; False: sinks + window + kept pages only
    # Formats pages step down to, in order, under a page byte limit; those no smaller
    # than the step before are skipped. k8cv4 keeps the keys (+0.3% perplexity on
    # SmolLM2 applied to every page), q4c +0.9%, q3c +4.4% (README, KVExec).
    pressure: tuple[str, ...] = ("k8cv4", "q4c", "q3c")
    # Fidelity floor: pages step down only to rungs whose measured teacher-forced top-1
    # for this model (`measured_top1`, format -> top-1 from bench/quality.py against
    # float16 pages) is at least `fidelity_floor`; an unmeasured rung ends the ladder.
    # None: every rung. Past the floor, `past_floor` says what happens: "refuse" (the
    # planner sizes with the last allowed rung and refuses what does not fit) or
    # "retain" (unpinned pages are dropped as retention's `policy` chooses, to stay within the limit).
    fidelity_floor: float | None = None
    measured_top1: tuple[tuple[str, float], ...] = ()
    past_floor: str = "refuse"

    def __post_init__(self) -> None:
        object.__setattr__(self, "pressure", tuple(self.pressure))  # JSON gives lists back
        measured = self.measured_top1.items() if isinstance(self.measured_top1, dict) else self.measured_top1
        object.__setattr__(self, "measured_top1", tuple((str(k), float(v)) for k, v in measured))
        if self.fidelity_floor is not None and not 0 < self.fidelity_floor <= 1:
            raise ValueError(f"fidelity_floor must be in (0, 1], not {self.fidelity_floor}")
        if self.past_floor not in ("refuse", "retain"):
            raise ValueError(f"past_floor must be refuse or retain, not {self.past_floor!r}")
        for name in (self.format, *self.pressure):
            get_format(name)
        if self.policy not in ("score", "random"):
            raise ValueError(f"retention policy must be score or random, not {self.policy!r}")
        if self.max_positions is not None and self.max_positions < self.sink_tokens + self.hot_window + self.page_size:
            raise ValueError("max_positions must hold the sinks, the hot window and one page")
        if self.page_size < 1 or self.hot_window < 0 or self.sink_tokens < 0:
            raise ValueError("page_size must be >= 1; hot_window and sink_tokens >= 0")
        if self.block_tokens < self.page_size:
            raise ValueError("block_tokens must be at least one page")


def next_segment_capacity(held: int, page: int, limit: int) -> int:
    """Capacity of the segment that follows `held` paged positions: doubling up to
    `limit`, so a short context wastes little and a long one allocates rarely."""
    return min(limit, max(page, held // page * page))


def allocated_positions(paged: int, page: int, limit: int) -> int:
    """Positions the segments holding `paged` positions have room for."""
    held = 0
    while held < paged:
        step = next_segment_capacity(held, page, limit)
        if step == limit:  # every later segment is `limit` too: the rest in one step (plans at 1M+ positions)
            return held + -(-(paged - held) // limit) * limit
        held += step
    return held


def ladder(config: KVConfig, head_dim: int) -> list[KVFormat]:
    """The page format, then each pressure format that stores this head_dim in pages
    of `page_size` and takes fewer bytes than the step before it, down to the last rung
    that holds the fidelity floor (when one is set)."""
    steps = [get_format(config.format)]
    measured = dict(config.measured_top1)
    for name in config.pressure:
        if config.fidelity_floor is not None and measured.get(name, -1.0) < config.fidelity_floor:
            break  # this rung (and every smaller one after it) is below the floor or unmeasured
        fmt = get_format(name)
        if (fmt.supports_head_dim(head_dim) and config.page_size % fmt.token_multiple == 0
                and fmt.bytes_per_token(1, head_dim) < steps[-1].bytes_per_token(1, head_dim)):
            steps.append(fmt)
    return steps


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=-2)


@dataclass
class Segment:
    """Preallocated storage for consecutive pages; pages are written in place."""

    start: int  # position of its first token
    capacity: int
    keys: dict[str, mx.array]
    values: dict[str, mx.array]
    fmt: KVFormat
    length: int = 0
    score: float = 0.0  # attention mass received (retention's "score" policy)
    key_min: mx.array | None = None  # per-channel key bounds (page selection)
    key_max: mx.array | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys.values(), *self.values.values()))


@dataclass
class PageStore:
    config: KVConfig = field(default_factory=KVConfig)
    window: int | None = None  # sliding-window layers: keys older than this are dead

    def __post_init__(self) -> None:
        self.fmt: KVFormat = get_format(self.config.format)
        if self.config.page_size % self.fmt.token_multiple:
            raise ValueError(f"{self.fmt.name} needs pages of a multiple of {self.fmt.token_multiple} tokens")
        self.full = get_format("fp32")  # how sinks and the hot window are read
        P = self.config.page_size
        self.sinks = 0 if self.window else self.config.sink_tokens
        cap = self.config.block_tokens // P * P
        if self.window:  # a ring needs only about one window per segment
            cap = min(cap, -(-self.window // P) * P)
        if self.config.max_positions is not None or self.config.select_pages:
            cap = P  # one page per segment: pages are evicted and selected one by one
        self.segment_capacity = cap
        self.pinned = 0  # positions below this (the prompt) are never evicted
        self.evicted = 0
        self._rng = random.Random(0)
        self.sink_k = self.sink_v = None
        self.segments: list[Segment] = []
        self.hot_k = self.hot_v = None
        self.offset = 0  # positions written so far
        self.page_limit: int | None = None  # bytes the segments may take (see module doc)
        self._ladder: list[KVFormat] | None = None  # known once head_dim is

    # -- writing -------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add [B, kv_heads, L, D] keys/values at positions offset .. offset + L - 1."""
        L, D = keys.shape[-2], keys.shape[-1]
        if not self.fmt.supports_head_dim(D):
            raise ValueError(f"KV format {self.fmt.name} needs a head_dim divisible by 32, not {D}")
        if self._ladder is None:
            self._ladder = ladder(self.config, D)
        have = 0 if self.sink_k is None else self.sink_k.shape[-2]
        take = min(L, self.sinks - have)
        if take > 0:
            self.sink_k = _cat(self.sink_k, keys[..., :take, :])
            self.sink_v = _cat(self.sink_v, values[..., :take, :])
            keys, values = keys[..., take:, :], values[..., take:, :]
        if keys.shape[-2]:
            self.hot_k, self.hot_v = _cat(self.hot_k, keys), _cat(self.hot_v, values)
        first_query = self.offset  # this call's queries start here
        self.offset += L
        self._flush()
        self._drop_dead(first_query)
        self._evict()

    def _hot_len(self) -> int:
        return 0 if self.hot_k is None else self.hot_k.shape[-2]

    def _flush(self) -> None:
        P = self.config.page_size
        while self._hot_len() >= self.config.hot_window + P:
            start = self.offset - self._hot_len()
            k, v = self.hot_k[..., :P, :], self.hot_v[..., :P, :]
            seg = self.segments[-1] if self.segments else None
            if seg is None or seg.length + P > seg.capacity:
                # Capacities double up to a block, so a short context wastes little.
                cap = next_segment_capacity(sum(s.length for s in self.segments), P, self.segment_capacity)
                lead, D = tuple(k.shape[:2]), k.shape[-1]
                per_token = self.fmt.bytes_per_token(lead[0] * lead[1], D)
                cap = self._fitting_capacity(cap, per_token)
                self._relieve(int(per_token * cap))
                seg = Segment(start, cap, self.fmt.keys.allocate(lead, cap, D),
                              self.fmt.values.allocate(lead, cap, D), self.fmt)
                self.segments.append(seg)
            seg.fmt.keys.write(seg.keys, seg.fmt.keys.encode(k), seg.length, P)
            seg.fmt.values.write(seg.values, seg.fmt.values.encode(v), seg.length, P)
            seg.length += P
            if self.config.select_pages:
                seg.key_min, seg.key_max = k.min(axis=-2), k.max(axis=-2)
            if self.page_limit is not None and seg.length == seg.capacity:
                self._merge_with_previous(seg)  # small segments made under the limit coalesce
            # A slice: the flushed tokens' buffer goes with the next append's concatenate.
            self.hot_k, self.hot_v = self.hot_k[..., P:, :], self.hot_v[..., P:, :]

    def _fitting_capacity(self, cap: int, per_token: float) -> int:
        """Under a page limit, the largest of cap, cap/2, ... (whole pages) that fits
        beside the pages as they are, else one page: making room for a doubled segment
        would step every older page down at once, for positions not yet written."""
        P = self.config.page_size
        if self.page_limit is None:
            return cap
        room = self.page_limit - self.page_bytes()
        while cap > P and per_token * cap > room:
            cap = max(P, cap // 2 // P * P)
        return cap

    def page_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def limit(self, page_bytes: int | None) -> None:
        """Hold the pages to `page_bytes` (None: no limit), stepping down now what
        already passes it: the request that set it was planned with them that small."""
        self.page_limit = page_bytes
        self._relieve(0)

    def _relieve(self, incoming: int) -> None:
        """Step pages down the pressure ladder until `incoming` more bytes fit the
        page limit, or no page can step further (the planner sized the limit so the
        ladder's last format fits)."""
        if self._ladder is None and self.hot_k is not None:  # restored from a snapshot
            self._ladder = ladder(self.config, self.hot_k.shape[-1])
        if self.page_limit is None or self._ladder is None:
            return
        steps = self._ladder
        while self.page_bytes() + incoming > self.page_limit:
            movable = [s for s in self.segments if s.fmt != steps[-1] and s.fmt in steps]
            if not movable:
                if self.config.past_floor == "retain":
                    self._drop_for(incoming)
                return
            seg = min(movable, key=lambda s: (steps.index(s.fmt), s.start))
            _reencode(seg, steps[steps.index(seg.fmt) + 1])
            self._merge_with_previous(seg)

    def _drop_for(self, incoming: int) -> None:
        """Past the fidelity floor with `past_floor="retain"`: drop unpinned segments
        (as retention does) until `incoming` bytes fit."""
        while self.page_bytes() + incoming > self.page_limit and self._drop_one():
            pass

    def _merge_with_previous(self, seg: Segment) -> None:
        """Join `seg` to the segment before it when both are full, share a format and
        together fit one block: the small segments made under a page limit do not stay
        small blocks for every decode step to visit one by one. (Retention and page
        selection keep one page per segment.)"""
        i = next(j for j, s in enumerate(self.segments) if s is seg)  # by identity: fields hold arrays
        if i == 0 or self.segment_capacity == self.config.page_size:
            return
        prev = self.segments[i - 1]
        if (prev.fmt != seg.fmt or prev.length != prev.capacity or seg.length != seg.capacity
                or prev.capacity + seg.capacity > self.segment_capacity):
            return
        joined = []
        for codec, a, b in ((seg.fmt.keys, prev.keys, seg.keys), (seg.fmt.values, prev.values, seg.values)):
            axis = -1 if codec.tokens_last else -2
            joined.append({name: mx.concatenate([a[name], b[name]], axis=axis) for name in a})
        mx.eval(joined)  # the two old storages are freed now
        prev.keys, prev.values = joined
        prev.capacity += seg.capacity
        prev.length += seg.length
        prev.score += seg.score
        self.segments.pop(i)

    def _drop_dead(self, first_query: int) -> None:
        if self.window is None:
            return
        # No query from `first_query` on sees positions <= first_query - window.
        while self.segments and self.segments[0].start + self.segments[0].length <= first_query - self.window:
            self.segments.pop(0)

    def retained(self) -> int:
        sinks = 0 if self.sink_k is None else self.sink_k.shape[-2]
        return sinks + sum(s.length for s in self.segments) + self._hot_len()

    def _evict(self) -> None:
        """Retention: drop generated (unpinned) pages until the budget holds."""
        budget = self.config.max_positions
        if budget is None:
            return
        while self.retained() > budget and self._drop_one():
            pass  # stops with only pinned tokens left; the planner refuses such requests up front

    def _drop_one(self) -> bool:
        """Drop one unpinned segment, chosen by the retention policy (least attended,
        oldest first among equals, or random); False when none is left to drop."""
        movable = [i for i, s in enumerate(self.segments) if s.start >= max(self.pinned, self.sinks)]
        if not movable:
            return False
        if self.config.policy == "random":
            i = self._rng.choice(movable)
        else:
            i = min(movable, key=lambda j: (self.segments[j].score, j))
        self.evicted += self.segments.pop(i).length
        return True

    def observe(self, block: Block, mass: float) -> None:
        """Attention mass a block received (summed over heads and queries)."""
        if isinstance(block.tag, Segment):
            block.tag.score += mass

    # -- reading -------------------------------------------------------------
    @property
    def pages(self) -> int:
        return sum(s.length for s in self.segments) // self.config.page_size

    def first_position(self) -> int:
        """Oldest position still held (sinks aside)."""
        if self.segments:
            return self.segments[0].start
        return self.offset - self._hot_len()

    def _selected(self, queries: mx.array | None) -> list[Segment]:
        """Quest-style page selection for one decode query: the k pages whose keys
        could score highest (per-channel min/max bound), in position order."""
        k = self.config.select_pages
        if not k or queries is None or queries.shape[-2] != 1 or len(self.segments) <= k:
            return self.segments
        B, H, _, D = queries.shape
        kvh = self.segments[0].key_min.shape[1]
        q = queries.astype(mx.float32).reshape(B, kvh, H // kvh, D)[:, None]  # [B, 1, kvh, rep, D]
        lo = mx.stack([s.key_min for s in self.segments], axis=1)[:, :, :, None]  # [B, n, kvh, 1, D]
        hi = mx.stack([s.key_max for s in self.segments], axis=1)[:, :, :, None]
        bound = mx.maximum(q * lo, q * hi).sum(axis=-1).max(axis=(0, 2, 3))  # [n]
        top = sorted(mx.argsort(-bound)[:k].tolist())
        return [self.segments[i] for i in top]

    def blocks(self, queries: mx.array | None = None):
        """Blocks in position order, in their stored form; each at most block_tokens.
        Given decode `queries` and select_pages, only the selected pages come."""
        if self.sink_k is not None:
            yield Block({"x": self.sink_k}, {"x": self.sink_v}, self.full, 0, self.sink_k.shape[-2])
        for seg in self._selected(queries):
            yield Block(seg.fmt.keys.view(seg.keys, 0, seg.length), seg.fmt.values.view(seg.values, 0, seg.length),
                        seg.fmt, seg.start, seg.length, tag=seg)
        if self._hot_len():
            yield Block({"x": self.hot_k}, {"x": self.hot_v}, self.full, self.offset - self._hot_len(),
                        self._hot_len())

    # -- trimming ------------------------------------------------------------
    def can_trim(self, n: int) -> bool:
        """Whether the last n positions can be removed with everything a later query
        needs still held (sliding layers may have dropped it)."""
        if n > self.offset or (self.evicted and n > self._hot_len()):
            return False  # evicted pages cannot come back
        if self.window is None:
            return True
        return self.first_position() <= max(0, self.offset - n - self.window)

    def trim(self, n: int) -> int:
        if n <= 0 or not self.can_trim(n):
            return 0
        target = self.offset - n
        hot_start = self.offset - self._hot_len()
        dtype = self.hot_dtype()
        P = self.config.page_size
        while target < hot_start and self.segments:
            seg = self.segments[-1]
            keep = max(0, target - seg.start) // P * P  # whole pages stay
            # Back into the hot window as the values attention saw for them.
            back = [codec.decode(codec.view(part, keep, seg.length)).astype(dtype)
                    for codec, part in ((seg.fmt.keys, seg.keys), (seg.fmt.values, seg.values))]
            self.hot_k = back[0] if self.hot_k is None else mx.concatenate([back[0], self.hot_k], axis=-2)
            self.hot_v = back[1] if self.hot_v is None else mx.concatenate([back[1], self.hot_v], axis=-2)
            hot_start = seg.start + keep
            seg.length = keep
            if keep == 0:
                self.segments.pop()
        if target < self.sinks:
            self.sink_k = None if target == 0 else self.sink_k[..., :target, :]
            self.sink_v = None if target == 0 else self.sink_v[..., :target, :]
            self.hot_k = self.hot_v = None
        elif self.hot_k is not None:
            keep = target - hot_start
            self.hot_k, self.hot_v = self.hot_k[..., :keep, :], self.hot_v[..., :keep, :]
        self.offset = target
        return n

    def formats(self) -> dict[str, int]:
        """Paged positions per format (several once pages stepped down)."""
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.fmt.name] = out.get(s.fmt.name, 0) + s.length
        return out

    def hot_dtype(self) -> mx.Dtype:
        ref = self.hot_k if self.hot_k is not None else self.sink_k
        return mx.float32 if ref is None else ref.dtype

    # -- accounting ----------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held, allocated segment capacity included."""
        arrays = [a for a in (self.sink_k, self.sink_v, self.hot_k, self.hot_v) if a is not None]
        return sum(a.nbytes for a in arrays) + sum(s.nbytes for s in self.segments)

    def arrays(self) -> list[mx.array]:
        out = [a for a in (self.sink_k, self.sink_v, self.hot_k, self.hot_v) if a is not None]
        for s in self.segments:
            out.extend(s.keys.values())
            out.extend(s.values.values())
        return out


def _reencode(seg: Segment, fmt: KVFormat) -> None:
    """Store `seg`'s tokens in `fmt` (same capacity); a codec both formats share is kept."""
    parts = []
    for old, new, storage in ((seg.fmt.keys, fmt.keys, seg.keys), (seg.fmt.values, fmt.values, seg.values)):
        if old == new:
            parts.append(storage)
            continue
        x = old.decode(old.view(storage, 0, seg.length))
        lead, D = tuple(x.shape[:2]), x.shape[-1]
        out = new.allocate(lead, seg.capacity, D)
        new.write(out, new.encode(x), 0, seg.length)
        mx.eval(out)  # the old storage is freed now, not when attention next reads it
        parts.append(out)
    seg.keys, seg.values, seg.fmt = parts[0], parts[1], fmt

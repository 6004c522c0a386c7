"""The pressure ladder: under a page byte limit (the engine sets one from its budget),
segments first give back room no page is written in, then pages step down to smaller
formats (`KVConfig.pressure`) before a new segment would pass it: the oldest segment
of the widest format first, so every page steps down once before any steps twice, and
the segment being filled stays in the page format. Past the fidelity floor,
`KVConfig.past_floor="retain"` drops pages instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvexec.config import KVConfig
from kvexec.formats import KVFormat, get_format
from kvexec.segments import merge_with_previous, reencode, release_unwritten

if TYPE_CHECKING:
    from kvexec.store import PageStore


def ladder(config: KVConfig, head_dim: int, layer: int = 0) -> list[KVFormat]:
    """The page format, then each pressure format that stores this head_dim in pages
    of `page_size` and takes fewer bytes than the step before it, down to the last rung
    that holds the fidelity floor (when one is set). With per-layer formats (a
    calibrated configuration), attention layer `layer`'s ladder."""
    steps = [get_format(config.layer_formats[layer] if config.layer_formats else config.format)]
    measured = dict(config.measured_top1)
    for name in config.pressure:
        if config.fidelity_floor is not None and measured.get(name, -1.0) < config.fidelity_floor:
            break  # this rung (and every smaller one after it) is below the floor or unmeasured
        fmt = get_format(name)
        if (fmt.supports_head_dim(head_dim) and config.page_size % fmt.token_multiple == 0
                and fmt.bytes_per_token(1, head_dim) < steps[-1].bytes_per_token(1, head_dim)):
            steps.append(fmt)
    return steps


def relieve(store: PageStore, steps: list[KVFormat], incoming: int) -> None:
    """Step `store`'s pages down `steps` until `incoming` more bytes fit its page limit,
    or no page can step further (the planner sized the limit so the ladder's last
    format fits); then, past the floor with past_floor="retain", drop pages as
    retention chooses."""
    limit = store.page_limit
    if limit is None:
        return
    if store.page_bytes() + incoming > limit:
        for seg in store.segments:  # room no page is written in goes first
            release_unwritten(seg)
    while store.page_bytes() + incoming > limit:
        movable = [s for s in store.segments if s.fmt != steps[-1] and s.fmt in steps and s.extent is None]
        if not movable:
            if store.config.past_floor == "retain":
                while store.page_bytes() + incoming > limit and store.retention.drop_one(store):
                    pass
            return
        seg = min(movable, key=lambda s: (steps.index(s.fmt), s.start))
        reencode(seg, steps[steps.index(seg.fmt) + 1])
        merge_with_previous(store.segments, seg, store.segment_capacity, store.config.page_size)

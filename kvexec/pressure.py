"""The pressure ladder: under a page byte limit (the engine sets one from its budget),
segments first give back room no page is written in, then pages step down to smaller
formats (`KVConfig.pressure`) before a new segment would pass it: the oldest segment
of the widest format first, so every page steps down once before any steps twice, and
the segment being filled stays in the page format. Past the fidelity floor,
`KVConfig.past_floor="retain"` drops pages instead. This module decides (the ladder,
which segment steps down next); the store (kvexec/store.py) applies."""

from __future__ import annotations

from kvexec.config import KVConfig
from kvexec.formats import KVFormat, get_format
from kvexec.segments import Segment


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


def step_down(segments: list[Segment], steps: list[KVFormat]) -> tuple[Segment, KVFormat] | None:
    """The segment to re-encode next and the format it steps down to: the oldest of the
    widest format that can still step (a segment on disk stays as written); None when
    no page can step further (the planner sized the limit so the ladder's last format
    fits)."""
    movable = [s for s in segments if s.fmt != steps[-1] and s.fmt in steps and s.extent is None]
    if not movable:
        return None
    seg = min(movable, key=lambda s: (steps.index(s.fmt), s.start))
    return seg, steps[steps.index(seg.fmt) + 1]

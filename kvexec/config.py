"""KVConfig: how KVExec keeps one sequence's KV (page format, hot window, sinks,
attention blocks, retention, page selection, the pressure ladder and its fidelity floor)."""

from __future__ import annotations

from dataclasses import dataclass

from kvexec.formats import get_format, needs_model


@dataclass(frozen=True)
class KVConfig:
    """How KVExec keeps each attention layer's KV; see the fields."""

    # q8c: a fixed format with no measurable loss on the models tested, and the fastest
    # to decode on CPU (bench/quality.py, bench/kv.py). "calibrated" (the CLI's default)
    # is smaller at the same fidelity but needs the model to resolve (justfit.Engine does).
    format: str = "q8c"
    page_size: int = 256
    hot_window: int = 256  # most recent tokens kept in full precision
    # Bits of the full-precision tokens (sinks, hot window): 16 keeps float32 activations'
    # keys and values in float16, the fidelity reference's own precision, at half the
    # bytes; 32 as computed. Float32 pages keep them at 32, 16-bit activations their own.
    full_bits: int = 16
    sink_tokens: int = 4  # first tokens kept in full precision (global layers)
    block_tokens: int = 2048  # tokens decoded per attention block: bounds the transient
    max_positions: int | None = None  # retention: positions kept per layer (None: all)
    policy: str = "score"  # what retention evicts first: "score" (least attended) or "random"
    select_pages: int | None = None  # decode attends to the top-k pages by key bound (Quest)
    pin_prompt: bool = True  # retention keeps every prompt position; False: sinks + window + kept pages only
    # Formats pages step down to, in order, under a page byte limit; those no smaller
    # than the step before are skipped. Ordered by measured loss, smallest first
    # (k8cv4 keeps 8-bit keys; bench/quality.py measures each).
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
    # Per attention layer, its page format (a calibrated configuration, kvexec.calibrate);
    # empty: every layer in `format`.
    layer_formats: tuple[str, ...] = ()
    # With format "calibrated": the output KL (nats per token) all layers' pages together
    # may add in calibration's layout (None: kvexec.calibrate.TOLERANCE).
    calibration_tolerance: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pressure", tuple(self.pressure))  # JSON gives lists back
        object.__setattr__(self, "layer_formats", tuple(self.layer_formats))
        measured = self.measured_top1.items() if isinstance(self.measured_top1, dict) else self.measured_top1
        object.__setattr__(self, "measured_top1", tuple((str(k), float(v)) for k, v in measured))
        if self.fidelity_floor is not None and not 0 < self.fidelity_floor <= 1:
            raise ValueError(f"fidelity_floor must be in (0, 1], not {self.fidelity_floor}")
        if self.past_floor not in ("refuse", "retain"):
            raise ValueError(f"past_floor must be refuse or retain, not {self.past_floor!r}")
        for name in (self.format, *self.pressure, *self.layer_formats):
            if not (name == self.format and needs_model(name)):
                get_format(name)
        if self.policy not in ("score", "random"):
            raise ValueError(f"retention policy must be score or random, not {self.policy!r}")
        if self.max_positions is not None and self.max_positions < self.sink_tokens + self.hot_window + self.page_size:
            raise ValueError("max_positions must hold the sinks, the hot window and one page")
        if self.full_bits not in (16, 32):
            raise ValueError(f"full_bits must be 16 or 32, not {self.full_bits}")
        if self.page_size < 1 or self.hot_window < 0 or self.sink_tokens < 0:
            raise ValueError("page_size must be >= 1; hot_window and sink_tokens >= 0")
        if self.block_tokens < self.page_size:
            raise ValueError("block_tokens must be at least one page")

    def full_bytes(self, act_bytes: int) -> int:
        """Bytes of one full-precision value (sinks, hot window) under activations of
        `act_bytes` (what PageStore stores them in)."""
        return act_bytes if self.full_bits == 32 or self.format == "fp32" else min(act_bytes, 2)

"""The engine's memory budget now (`Budget`), one of the engine's parts.

Under a whole-process budget, the engine's share is the budget less the outside share:
what the process holds besides MLX (interpreter, libraries, tokenizer, BLAS buffers,
Python objects), measured after each request and kept as a decaying maximum over
recent requests.

The peak of a request counts, not only what is left after it: while requests run, a
thread (`OutsideWatch`) samples the process's resident set less MLX's active bytes every
10 ms, since the kernel's high-water mark, once an earlier request set it, no longer
says what a later one held besides MLX at its peak.

The planner's reserve is measured the same way, under any budget: after each request,
the share by which MLX's peak exceeded what the planner predicted for it (its
footprint's terms at the request's own length and chunk: allocator rounding, transients
the terms leave out), kept as a decaying maximum (`Budget.remeasure_reserve`); the
planner's prior (2% + 256 KiB) until a request has run.

A lifetime maximum would be a ratchet: one spike (a huge prompt's tokenization, a
burst of objects) would shrink the engine's share for good. Here a sample above the
estimate is taken at once (a sustained rise is honoured from its first request);
below it, the excess over the latest sample halves every `half_life` requests.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import psutil

from justfit.memory import peak_rss_bytes, rss_bytes, trim_heap
from justfit.planning.cost_model import PRIOR_RESERVE, Footprint, Reserve


@dataclass(frozen=True)
class OutsideDecay:
    """How fast the outside estimate forgets a past spike (see `decayed_max`)."""

    half_life: float = 8.0  # requests over which a past spike's excess halves

    def __post_init__(self) -> None:
        if not self.half_life > 0:
            raise ValueError(f"half_life must be > 0 requests, not {self.half_life}")


def decayed_max(estimate: int | float, sample: int | float, decay: OutsideDecay = OutsideDecay()) -> int | float:
    """The next estimate: `sample` when it is higher, else `sample` plus the previous
    excess over it, decayed by one request (whole bytes when both are ints)."""
    if sample >= estimate:
        return sample
    excess = (estimate - sample) * 0.5 ** (1 / decay.half_life)
    return sample + (int(excess) if isinstance(estimate, int) and isinstance(sample, int) else excess)


def reserve_sample(predicted: Footprint, mlx_peak: int, states: int = 0, besides: int = 0) -> float:
    """The share of `predicted`'s terms (a request's footprint at its own length and
    chunk, the reserve left out) by which its MLX peak `mlx_peak`, less the stored
    states `states` and what else MLX held when it began (`besides`: not the engine's,
    e.g. another engine in the process), exceeded them; 0 when the peak stayed within."""
    terms = predicted.terms
    return max(0, mlx_peak - states - besides - terms) / terms if terms > 0 else 0.0


class OutsideWatch:
    """The most the process held besides MLX at any moment while it ran: its resident
    set less MLX's active bytes, sampled every `every_s` by a thread until `stop`."""

    def __init__(self, every_s: float = 0.01):
        self.most = 0
        self._every = every_s
        self._stop = threading.Event()
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._run, name="justfit-outside-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            rss = self._process.memory_info().rss  # first: a buffer MLX allocates between the reads is not counted twice
            self.most = max(self.most, rss - mx.get_active_memory())
            if self._stop.wait(self._every):
                return

    def stop(self) -> int:
        """Stop sampling; the most seen (bytes)."""
        self._stop.set()
        self._thread.join()
        return self.most


def measure_outside(high_water: int = 0, mlx_peak: int = 0, seen: int = 0) -> int:
    """What the process holds besides MLX now, after a heap trim; the most an
    `OutsideWatch` saw while the request ran (`seen`); and, when the request raised the
    process's high-water mark above `high_water` (the mark before it), the mark less the
    request's MLX peak `mlx_peak`: the largest of these. (The kernel keeps one lifetime
    mark, which JustFit does not reset: benchmarks read it.)"""
    trim_heap()
    outside = max(rss_bytes() - mx.get_active_memory(), seen)
    peak = peak_rss_bytes()
    if mlx_peak and peak > high_water:
        outside = max(outside, peak - mlx_peak)
    return outside


@dataclass
class ProcessShare:
    """Under a whole-process budget, the engine's share: the budget less what the
    process holds besides MLX, a decaying maximum over requests (`decayed_max`), and
    less what it may come to hold outside MLX later and is set aside from load
    (`held_back`: constrained output's grammar cache and tokenizer, justfit.engine.grammar),
    the part of it `holding()` says is held already being in the measured share."""

    process_budget: int
    outside: int = 0
    held_back: int = 0
    holding: Callable[[], int] | None = None

    def remeasure(self, high_water: int = 0, mlx_peak: int = 0, seen: int = 0) -> int:
        """Measure the outside share again (after a request: `high_water`, `mlx_peak`,
        `seen`, see `measure_outside`); return the engine's share now."""
        self.outside = decayed_max(self.outside, measure_outside(high_water, mlx_peak, seen))
        held = self.holding() if self.holding is not None else 0
        return self.process_budget - self.outside - max(0, self.held_back - held)


class Budget:
    """The engine's memory budget now (None: none): fixed, or under a whole-process
    budget the process's budget less what it holds besides MLX, measured again after
    requests. The engine builds one and keeps it; the value changes here, under a lock,
    never the engine's configuration (which keeps the budget given at load)."""

    def __init__(self, nbytes: int | None, share: ProcessShare | None = None, decay: OutsideDecay = OutsideDecay()):
        self._lock = threading.Lock()
        self._bytes, self._share = nbytes, share
        self._decay = decay
        self._reserve: Reserve | None = None  # measured after requests under a budget (None: none yet)

    @property
    def reserve(self) -> Reserve:
        """What plans keep back beyond their terms: under a budget, once a request ran,
        the measured share (`remeasure_reserve`); the planner's prior otherwise."""
        measured = self._reserve
        return measured if measured is not None and self._bytes is not None else PRIOR_RESERVE

    def remeasure_reserve(self, predicted: Footprint, mlx_peak: int, states: int = 0, besides: int = 0) -> None:
        """Under a budget, after a request: how far its MLX peak went past `predicted`
        (its footprint at the length it reached and the chunk it used, `reserve_sample`),
        kept as a decaying maximum over requests; the first measurement replaces the
        prior. Nothing without a budget or a peak (a request that computed nothing)."""
        if self._bytes is None or mlx_peak <= 0 or predicted.terms <= 0:
            return
        sample = reserve_sample(predicted, mlx_peak, states, besides)
        with self._lock:
            last = self._reserve
            share = sample if last is None else decayed_max(last.share, sample, self._decay)
            self._reserve = Reserve(share, 0, True, (last.requests if last else 0) + 1)

    @property
    def bytes(self) -> int | None:
        """The engine's budget in bytes now (None: no budget)."""
        return self._bytes

    @property
    def process(self) -> int | None:
        """The whole-process budget the engine's share comes from (None: the budget, if
        any, covers the engine alone)."""
        share = self._share
        return share.process_budget if share is not None else None

    def set(self, nbytes: int) -> None:
        """Hold the engine to `nbytes` from now on (covering the engine alone)."""
        with self._lock:
            self._bytes, self._share = nbytes, None

    def remeasure(self, high_water: int = 0, mlx_peak: int = 0, seen: int = 0) -> None:
        """Under a whole-process budget, take what the process holds besides MLX off the
        engine's share again (`ProcessShare.remeasure`); nothing otherwise."""
        with self._lock:
            if self._share is not None:
                self._bytes = self._share.remeasure(high_water, mlx_peak, seen)

    def watch(self) -> OutsideWatch | None:
        """Under a whole-process budget, a started watch of what the process holds
        besides MLX while requests run (its `stop()` goes to `remeasure` as `seen`);
        None otherwise (nothing to measure it for)."""
        return OutsideWatch() if self._share is not None else None

    @contextlib.contextmanager
    def trial(self, nbytes: int | None):
        """Within the block, plan as if the budget were `nbytes` (`justfit fit` asks
        what another budget would hold); as before after it."""
        with self._lock:
            saved = self._bytes, self._share
            self._bytes, self._share = nbytes, None
        try:
            yield self
        finally:
            with self._lock:
                self._bytes, self._share = saved

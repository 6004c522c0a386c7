"""One numerics per token: whether a reply depends on how the server computed it.

A token's hidden states, KV entries and logits can be computed in a prefill chunk of
any size, as a decode step, as a row of a batched step, or inside a verified draft.
Kernels that reduce in an order depending on how many rows share a call, and prefill
on other weight forms than decode, give each path slightly different logits, so a
greedy reply can change with a cached prefix, a chunk size, a batch or a draft.

`Numerics` is how this engine computes every token, chosen once at load:

- "row-invariant": every token on the decode forms, through kernels whose result for
  a row does not depend on the rows beside it (native/: the quantized products and
  KVExec's attention), prefill chunks cut at page flushes (kvexec.chunk_room). Any
  chunk, batch or draft gives bitwise the logits a lone decode step gives. Checked at
  load (`rows_agree`) on the model itself.
- "one-row": where no such kernels run (MLX's own kernels: the MLX-only path, Metal),
  determinism asked for computes one row per forward: prefill one token at a time, no
  batched rows, no drafts. Same promise, far slower prefill.
- "fast": dense prefill forms and whatever kernels are quickest; replies may differ
  between paths in their last bits (and then, rarely, in a greedy token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

import kvexec
from kvexec.kernels import rows_kernel
from phaseswap import PhaseSwap
from phaseswap.native import kernels

PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7)  # any ids: the check compares the model with itself


@dataclass(frozen=True)
class Numerics:
    """How the engine computes tokens (see the module's docstring)."""

    mode: str  # "row-invariant", "one-row" or "fast"
    reason: str  # why this mode, in words

    @property
    def deterministic(self) -> bool:
        """Whether a reply is the same on every path (cached, chunked, batched, drafted)."""
        return self.mode != "fast"

    @property
    def one_row(self) -> bool:
        """Whether each forward computes one row (prefill a token at a time, no batched rows, no drafts)."""
        return self.mode == "one-row"

    def as_dict(self) -> dict:
        """What `justfit fit` and /v1/justfit/status show."""
        return {"mode": self.mode, "deterministic": self.deterministic, "reason": self.reason}


def invariant_kernels() -> str | None:
    """Why row-invariant kernels cannot run here, or None where they can."""
    if mx.default_device() != mx.cpu:
        return "the native kernels run on the CPU only (MLX's Metal kernels promise no row invariance)"
    ext, rows = kernels(), rows_kernel()
    if ext is None or not hasattr(ext, "quantized_matvecs") or rows is None or not hasattr(rows, "decode_attention"):
        return "the native kernels are not loaded (JUSTFIT_NATIVE=0, or not built here)"
    return None


def rows_agree(model: nn.Module, swap: PhaseSwap, new_cache: Callable[[], list]) -> bool:
    """Whether `model` on its decode forms gives bitwise the same logits for a few tokens
    fed as one chunk as for the same tokens fed one step at a time."""
    def logits(sizes: list[int]) -> list[mx.array]:
        cache, out, at = new_cache(), [], 0
        kvexec.row_invariant(cache)
        for n in sizes:
            with swap.phase("decode"):
                out.append(model(mx.array(PROBE_TOKENS[at:at + n])[None], cache=cache)[0].astype(mx.float32))
            mx.eval(out[-1])
            at += n
        return out

    n = len(PROBE_TOKENS)
    chunk = logits([n])[0]
    steps = mx.concatenate(logits([1] * n))
    return bool(mx.array_equal(chunk, steps).item())


def choose(asked: bool | None, model: nn.Module, swap: PhaseSwap, new_cache: Callable[[], list],
           paged: bool) -> Numerics:
    """The engine's numerics: `asked` True (deterministic), False (fast) or None (row-
    invariant where the kernels are, else fast: one row at a time costs too much to be
    a default)."""
    if asked is False:
        return Numerics("fast", "asked for (--no-deterministic)")
    why_not = invariant_kernels() if paged else "the KV cache is not KVExec's (kv off)"
    if why_not is None and not rows_agree(model, swap, new_cache):
        why_not = "this model's decode forms gave other bits for a chunk than for single steps at load"
    if why_not is None:
        return Numerics("row-invariant", "native kernels whose rows do not depend on each other, checked at load")
    if asked:
        return Numerics("one-row", f"asked for, computed one row per forward: {why_not}")
    return Numerics("fast", f"replies may depend on the path: {why_not}")

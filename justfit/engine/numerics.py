"""One numerics per token: whether a reply depends on how the server computed it.

A token's hidden states, KV entries and logits can be computed in a prefill chunk of
any size, as a decode step, as a row of a batched step, or inside a verified draft.
Kernels that reduce in an order depending on how many rows share a call, and prefill
on other weight forms than decode, give each path slightly different logits, so a
greedy reply can change with a cached prefix, a chunk size, a batch or a draft.

`Numerics` is how this engine computes every token, chosen once at load:

- "fast" (the default): prefill on the dense forms, decode on the compact ones. With
  the native kernels a row's product and attention do not depend on the rows beside it,
  so a batched step, a verified draft, a repeat (the state trimmed back exactly,
  kvexec.exact), preemption and a restart give the reply a lone request gives; a cached
  prefix of another length or another prefill chunking may change its last bits (dense
  prefill rows against the stored ones) and then, rarely, a greedy token.
- "row-invariant" (`--deterministic` where the native kernels run): every token on the
  decode forms through those kernels, prefill chunks cut short of page flushes
  (kvexec.chunk_room): a prefill row is bitwise a decode step, so a reply is the same on
  every path, a conversation's next turn resumed or computed cold included. Checked at
  load (`rows_agree`) on the model itself. Costs prefill speed (docs/BENCHMARKS.md).
  Holds up to TWO_PASS_SCORES / query heads positions (SmolLM2: 466,033), where one
  position's attention scores stay a bounded transient (kvexec.attention.invariant_rows).
- "one-row" (`--deterministic` where MLX's own kernels run: the MLX-only path, Metal):
  one row per forward, prefill a token at a time, no batched rows, no drafts. The same
  promise, far slower prefill.
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


def choose(deterministic: bool, model: nn.Module, swap: PhaseSwap, new_cache: Callable[[], list],
           paged: bool) -> Numerics:
    """The engine's numerics (see the module's docstring)."""
    why_not = invariant_kernels() if paged else "the KV cache is not KVExec's (kv off)"
    if not deterministic:
        if why_not is None:
            return Numerics("fast", "dense prefill: a cached prefix or another chunking may change a reply's "
                                    "last bits; batches, drafts, repeats and restores do not")
        return Numerics("fast", f"replies may depend on the path: {why_not}")
    if why_not is None and not rows_agree(model, swap, new_cache):
        why_not = "this model's decode forms gave other bits for a chunk than for single steps at load"
    if why_not is None:
        return Numerics("row-invariant", "every token on the decode forms through native kernels whose rows do "
                                         "not depend on each other (checked at load)")
    return Numerics("one-row", f"one row per forward: {why_not}")

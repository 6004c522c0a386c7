"""A stock system's memory model, fitted to its measured points: where a float16 run
cannot reach a budget in the time it is given, its capacity there is modeled, never
taken from a float32 run.

    peak(P) = process baseline (weights loaded) + KV bytes(P) + chunk transient(P) + c

Baseline (RSS after load, before the first step; the weights' bytes, reported beside
it, are part of it) is measured in the worker; KV bytes per position follow from the cache's dtype and shape (checked against
the cache's own bytes); the transient is the planner's first-order model of mlx-lm's
prefill (scores, MLP and hidden activations of one chunk); `c`, what none of these
terms hold (allocator slack, MLX's buffer cache), is the mean residual over the
measured points, and the largest residual left is the model's error, shown with it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class MemoryModel:
    baseline: int  # bytes: the process before the first step, weights loaded
    weights: int  # of the baseline, for the breakdown
    kv_per_position: float
    transient_per_position: float  # attention scores grow with the positions they see
    transient_fixed: float  # MLP, hidden and logits of one chunk
    constant: float  # fitted: the mean residual
    error: float  # fitted: the largest |residual - constant| over the points
    points: int

    def peak(self, positions: int) -> float:
        """Modeled whole-process peak for `positions` retained positions, in bytes."""
        return (self.baseline + self.constant + self.transient_fixed
                + positions * (self.kv_per_position + self.transient_per_position))

    def capacity(self, budget: int) -> int:
        """The most positions whose modeled peak stays within `budget` (0 if none)."""
        per = self.kv_per_position + self.transient_per_position
        return max(0, int((budget - self.peak(0)) // per))

    def as_dict(self) -> dict:
        mib = lambda x: round(x / MIB, 2)  # noqa: E731
        return {"baseline_mib": mib(self.baseline), "weights_mib": mib(self.weights),
                "kv_bytes_per_position": round(self.kv_per_position, 1),
                "transient_bytes_per_position": round(self.transient_per_position, 1),
                "transient_fixed_mib": mib(self.transient_fixed), "constant_mib": mib(self.constant),
                "error_mib": mib(self.error), "points": self.points}


# Peak bytes of one mlx-lm prefill attention call per (chunk x query head x position
# seen), by (activation dtype, KV bits), measured on MLX 0.32's CPU backend at SmolLM2's
# shape, chunk 256, 2,048 positions seen (`python -m bench.attn_transient`): one scores
# array in the activations' dtype plus the mask, not float32 scores and exponentials as
# the planner assumes for JustFit's own path. The quantized-KV rows are mlx-lm's
# quantized_scaled_dot_product_attention (float16 scores and their softmax).
SCORE_BYTES = {("float16", None): 2.18, ("float32", None): 4.24, ("float16", 8): 2.64, ("float16", 4): 2.39}


def transient_terms(heads: int, hidden: int, intermediate: int, vocab: int, chunk: int,
                    act_bytes: int, score_bytes: float | None = None) -> tuple[float, float]:
    """(bytes per position seen, fixed bytes) of one prefill chunk: the attention
    scores, then MLP, hidden and logits rows. `score_bytes` is the measured peak of one
    attention call per (chunk x head x position seen) (bench/attn_transient.py); None
    keeps the planner's float32 scores and exponentials (justfit/planning/cost_model.py)."""
    per_position = chunk * heads * (4 * 2 if score_bytes is None else score_bytes)
    fixed = chunk * intermediate * 3 * act_bytes + chunk * hidden * 4 * act_bytes + vocab * 4
    return per_position, fixed


def fit(points: list[tuple[int, int]], baseline: int, weights: int, kv_per_position: float,
        transient: tuple[float, float]) -> MemoryModel:
    """The model through measured (positions, peak bytes) points. Baseline, weights and
    KV bytes are measured or follow from shapes, the transient from the attention peak
    measured on its own (`transient`); only the constant is fitted. A per-position
    slope fitted to short runs' points measures the allocator, not the KV (on short
    float32 stock runs it came out many times the true slope), so none is fitted."""
    if not points:
        raise ValueError("no measured points to fit")
    per, fixed = transient
    xs = [p for p, _ in points]
    residuals = [peak - baseline - fixed - p * kv_per_position for p, peak in points]
    left = [r - per * x for x, r in zip(xs, residuals)]
    constant = sum(left) / len(left)
    error = max(abs(v - constant) for v in left)
    return MemoryModel(baseline, weights, kv_per_position, per, fixed, constant, error, len(points))


def kv_bytes_per_position(layers: int, kv_heads: int, head_dim: int, itemsize: int, bits: int | None = None,
                          group: int = 64) -> float:
    """K+V bytes of one position over `layers` growing layers; with `bits`, mlx-lm's
    quantized cache (packed values plus a scale and a bias per group, in the dtype)."""
    per_value = itemsize if not bits else bits / 8 + 2 * itemsize / group
    return 2 * layers * kv_heads * head_dim * per_value

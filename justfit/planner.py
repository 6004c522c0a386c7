"""What a request will need in memory, before it runs.

A first-order model: resident weights + KV bytes per retained position (attention
layers grow with context, sliding-window layers stop at their window) + the largest
transient of one prefill chunk (attention scores, MLP activations, last-position
logits). KVExec and PhaseSwap will replace the KV and transient terms with their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from justfit.memory import tree_bytes, weight_bytes


@dataclass(frozen=True)
class _Shape:
    weights: int
    full_layers: int  # layers whose KV grows with every position
    windows: tuple[int, ...]  # window size of each sliding layer
    state_bytes: int  # constant per-sequence state (recurrent layers)
    kv_row: int  # bytes of K+V for one position in one layer
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    chunk: int
    act_bytes: int


@dataclass(frozen=True)
class Footprint:
    positions: int
    weights: int
    kv: int
    transient: int
    shape: _Shape

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.transient

    def max_positions(self, budget: int) -> int:
        """Largest position count whose footprint fits `budget` (0 if none)."""
        lo, hi = 0, 1
        while _estimate(self.shape, hi).total <= budget and hi < 1 << 30:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _estimate(self.shape, mid).total <= budget else (lo, mid)
        return lo

    def as_dict(self) -> dict[str, int]:
        return {"positions": self.positions, "weights": self.weights, "kv": self.kv,
                "transient": self.transient, "total": self.total}


def _estimate(s: _Shape, positions: int) -> Footprint:
    kv = s.kv_row * (s.full_layers * positions + sum(min(w, positions) for w in s.windows))
    chunk = min(s.chunk, max(positions, 1))
    scores = chunk * s.heads * positions * s.act_bytes
    mlp = chunk * s.intermediate * 3 * s.act_bytes
    hidden = chunk * s.hidden * 4 * s.act_bytes
    logits = s.vocab * 4
    return Footprint(positions, s.weights, kv + s.state_bytes, scores + mlp + hidden + logits, s)


def footprint(model: nn.Module, config: dict, positions: int, chunk: int = 512) -> Footprint:
    args = getattr(model, "args", None)
    cfg = config.get("text_config", config)

    def arg(name: str, default=None):
        return getattr(args, name, None) or cfg.get(name, default)

    hidden = arg("hidden_size")
    heads = arg("num_attention_heads")
    kv_heads = arg("num_key_value_heads", heads)
    head_dim = arg("head_dim") or hidden // heads
    act_bytes = 4 if _is_fp32(model) else 2
    full, windows, state = 0, [], 0
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            windows.append(c.max_size)
        elif isinstance(c, KVCache):
            full += 1
        else:
            state += tree_bytes(getattr(c, "state", []))
    shape = _Shape(
        weights=weight_bytes(model), full_layers=full, windows=tuple(windows), state_bytes=state,
        kv_row=2 * kv_heads * head_dim * act_bytes, heads=heads, hidden=hidden,
        intermediate=arg("intermediate_size", 4 * hidden), vocab=arg("vocab_size", 32000),
        chunk=chunk, act_bytes=act_bytes,
    )
    return _estimate(shape, positions)


def _is_fp32(model: nn.Module) -> bool:
    import mlx.core as mx

    emb = getattr(getattr(model, "model", model), "embed_tokens", None)
    weight = getattr(emb, "scales", None) if hasattr(emb, "scales") else getattr(emb, "weight", None)
    return weight is not None and weight.dtype == mx.float32

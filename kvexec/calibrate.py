"""Per-model calibration: the smallest page format each attention layer tolerates.

A short teacher-forced pass over a fixed built-in text (kvexec/calibration_text.txt)
records every layer's queries, keys and values (kvexec/layer_error.py); each candidate
format replays them with every position but the sinks in pages, and per layer the
smallest candidate whose attention output stays within `tolerance` (relative RMS
against float32 pages) is chosen, the widest candidate where none does. The result,
per-layer format names, is deterministic (a fixed text, a fixed layout, a CPU pass) and
cached per model identity, candidates and tolerance, so only a model's first load pays.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.nn as nn

from kvexec.config import KVConfig
from kvexec.formats import get_format
from kvexec.layer_error import layer_errors, record

VERSION = 1  # bump when the procedure changes: cached results of older ones are ignored
# Smallest first is not required: candidates are ordered by bytes per position.
CANDIDATES = ("k4cr128v4r64", "k4cr128v5r64", "k5cr128v5r64", "k6cr128v6r64", "q8c")
TOLERANCE = 0.03
# Every position but the sinks in pages: the harshest layout a long context has.
LAYOUT = KVConfig(format="fp32", page_size=128, hot_window=0, sink_tokens=4)
TEXT = Path(__file__).with_name("calibration_text.txt")


@dataclass(frozen=True)
class Calibration:
    """The page format chosen for each attention layer of a model, and the errors it was chosen by."""

    model: str  # the model identity it was measured for
    formats: tuple[str, ...]  # chosen format per attention layer
    errors: tuple[dict[str, float], ...]  # per layer, candidate -> relative attention error
    tolerance: float
    candidates: tuple[str, ...]
    tokens: int

    def bits_per_value(self, kv_heads: int, head_dim: int) -> float:
        """Mean storage bits per K or V value over the layers, metadata included."""
        return sum(get_format(f).bits_per_value(kv_heads, head_dim) for f in self.formats) / len(self.formats)

    def summary(self) -> str:
        """e.g. "k4cr128v4r64 x20, q8c x10" in first-layer order."""
        counts: dict[str, int] = {}
        for f in self.formats:
            counts[f] = counts.get(f, 0) + 1
        return ", ".join(f"{f} x{n}" for f, n in counts.items())


def _ordered(candidates, head_dim: int) -> list[str]:
    usable = [c for c in candidates if get_format(c).supports_head_dim(head_dim)]
    if not usable:
        raise ValueError(f"no calibration candidate stores head_dim {head_dim}")
    return sorted(usable, key=lambda c: get_format(c).bytes_per_token(1, head_dim))


def calibrate(model: nn.Module, tokenizer, identity: str, candidates=CANDIDATES, tolerance: float = TOLERANCE,
              max_tokens: int = 1024) -> Calibration:
    """Measure every candidate on every attention layer and choose per layer (see module doc)."""
    ids = list(tokenizer.encode(TEXT.read_text(encoding="utf-8")))[:max_tokens]
    records = record(model, ids)
    head_dim = records[0].keys[0].shape[-1]
    ordered = _ordered(candidates, head_dim)
    errors = layer_errors(records, ordered, LAYOUT)
    chosen = tuple(next((c for c in ordered if e[c] <= tolerance), ordered[-1]) for e in errors)
    rounded = tuple({c: round(e[c], 6) for c in ordered} for e in errors)
    return Calibration(identity, chosen, rounded, tolerance, tuple(ordered), len(ids))


def cache_key(identity: str, candidates, tolerance: float) -> str:
    """What a cached calibration is valid for: the model, the procedure and the text."""
    text = hashlib.sha256(TEXT.read_bytes()).hexdigest()
    blob = json.dumps([VERSION, identity, list(candidates), tolerance, text, asdict(LAYOUT)])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_calibration(model: nn.Module, tokenizer, identity: str, cache_dir: Path, candidates=CANDIDATES,
                       tolerance: float = TOLERANCE) -> Calibration:
    """`calibrate`, read from `cache_dir` when this model was calibrated the same way before."""
    path = Path(cache_dir) / f"kv-calibration-{cache_key(identity, candidates, tolerance)}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Calibration(data["model"], tuple(data["formats"]), tuple(data["errors"]), data["tolerance"],
                           tuple(data["candidates"]), data["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: measure again
    result = calibrate(model, tokenizer, identity, candidates, tolerance)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(result), indent=1), encoding="utf-8")
    os.replace(tmp, path)  # readers see the old file or the whole new one
    return result


def calibrated_config(config: KVConfig, calibration: Calibration) -> KVConfig:
    """`config` with each attention layer's pages in its calibrated format."""
    return replace(config, layer_formats=calibration.formats)

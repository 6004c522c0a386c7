"""Per-model calibration: the smallest page format each attention layer tolerates.

A short teacher-forced pass over a fixed built-in text (kvexec/calibration_text.txt)
records every layer's queries, keys and values and the output distribution with float32
pages (kvexec/layer_error.py). An allocated candidate (`k<mean>a<group>v...`,
kvexec/allocated.py) gets its per-channel key widths from that layer's record. Each
candidate replays each layer's record with every position but the sinks in pages (the
harshest layout a long context has): the layer's relative attention error. One more
forward pass, every layer in the smallest candidate, measures the output's KL divergence
from the reference; over the summed squared attention errors that gives the model's gain
(for small errors KL grows with the squared errors, layer by layer; the gain differs
between models several-fold). One pass is one draw of the quantization noise, and a
draw's KL rests on a few positions, so draws spread, and one draw on one core and the
same on two differ as much: a rounding that flips one code changes what later layers
quantize. So the pass is
made PROBE_DRAWS times, each with the pages' groups shifted one token (one more sink),
and the gain is their mean. A model-wide KL budget (`tolerance`, nats per token in this
layout) is then spent where it saves the most bytes (`allocate`): every layer starts in
its smallest candidate and, while the predicted KL (gain x summed squared errors) is
over budget, the layer whose next step buys the most predicted KL per byte steps up;
then any layer that can step back down within the budget does. (Splitting the budget
evenly, each layer held to the same error, chose more bits per value at the same budget:
its discrete steps left most layers well under their share.) A byte counts at the model's trained context: a sliding-window layer's pages
stop growing at its window, so its bytes count window / context of a full layer's (Gemma
3: 512 / 32,768). Such a layer (a share of at most 1/16) keeps its widest candidate
outright: its steps up come almost free, and the budget decides the formats of the full
layers, which hold every position of a long context. The result is deterministic on a
machine (a fixed text, a fixed layout, a CPU pass); across machines the per-layer errors
agree closely and the gain to a few percent, and with it a layer near the budget's edge
may differ. The measurement is cached per model identity and candidates (any tolerance
chooses from it), so only a model's first load pays."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvexec.allocated import TEMPLATE, allocate_widths, channel_weights, widths_text
from kvexec.config import KVConfig
from kvexec.formats import get_format
from kvexec.layer_error import ROWS, TOP, LayerRecord, layer_errors, output_kl, record

VERSION = 6  # bump when the procedure changes: cached results of older ones are ignored
# Smallest first is not required: candidates are ordered by bytes per position.
CANDIDATES = ("k4a128v4r64", "k5a128v4r64", "k5a128v5r64", "k6a128v5r64", "k6a128v6r64", "k8c128v6r64", "q8c")
# Output KL (nats per token) all layers' pages together may add, in LAYOUT: the largest
# budget whose choice held top-1 >= 99%, KL <= 1e-3 and perplexity within 0.5% on both
# offline models (docs/BENCHMARKS.md, the default pages).
TOLERANCE = 1e-3
# A layer holding at most this share of the trained context (a sliding window's pages
# stop growing there) keeps its widest candidate: its bytes at a long context are a few
# MiB, and errors spent there save almost nothing while costing fidelity.
WIDEST_SHARE = 1 / 16
# Every position but the sinks in pages: the harshest layout a long context has (the
# sinks exact, so the error measured is the pages' alone).
LAYOUT = KVConfig(format="fp32", page_size=128, hot_window=0, sink_tokens=4, full_bits=32)
# Draws of the quantization noise the gain is averaged over (see module doc): six narrow
# the spread between machines several-fold for a few seconds more on a first load.
PROBE_DRAWS = 6
TEXT = Path(__file__).with_name("calibration_text.txt")
# Positions of the text calibration feeds (its first tokens).
MAX_TOKENS = 512


@dataclass(frozen=True)
class Calibration:
    """The page format chosen for each attention layer of a model, and the errors it was chosen by."""

    model: str  # the model identity it was measured for
    formats: tuple[str, ...]  # chosen format per attention layer
    errors: tuple[dict[str, float], ...]  # per layer, candidate -> relative attention error
    tolerance: float
    candidates: tuple[str, ...]
    tokens: int
    gain: float = 0.0  # output KL per summed squared attention error (see module doc)
    shares: tuple[float, ...] = ()  # per layer, the share of the trained context it holds (empty: all 1)

    def bits_per_value(self, kv_heads: int, head_dim: int, growing: bool = False) -> float:
        """Mean storage bits per K or V value over the layers, metadata included; `growing`:
        over the layers that hold every position (share 1), what a long context adds."""
        formats = [f for f, s in zip(self.formats, self.shares or (1.0,) * len(self.formats))
                   if not growing or s >= 1.0] or list(self.formats)
        return sum(get_format(f).bits_per_value(kv_heads, head_dim) for f in formats) / len(formats)

    def summary(self) -> str:
        """e.g. "k5a128v4r64 x20, q8c x10" in first-layer order (allocated widths left out)."""
        return layer_summary(self.formats)


def layer_summary(formats) -> str:
    """Per-layer formats as "k5a128v4r64 x20, q8c x10", in first-layer order."""
    counts: dict[str, int] = {}
    for f in formats:
        counts[get_format(f).label] = counts.get(get_format(f).label, 0) + 1
    return ", ".join(f"{f} x{n}" for f, n in counts.items())


def resolve(candidate: str, rec: LayerRecord) -> str:
    """The format a candidate names for this layer: an allocated one with the widths its
    record's queries and keys call for, any other as it is."""
    m = TEMPLATE.fullmatch(candidate)
    if m is None:
        return candidate
    queries = np.array(mx.concatenate(rec.queries, axis=-2)[0])
    keys = np.array(mx.concatenate(rec.keys, axis=-2)[0])
    widths = allocate_widths(channel_weights(queries, keys, int(m.group(2))), int(m.group(1)))
    return f"{candidate}~{widths_text(widths)}"


def _ordered(candidates, records: list[LayerRecord]) -> list[list[str]]:
    """Per layer, the usable candidates resolved for it, smallest first."""
    head_dim = records[0].keys[0].shape[-1]
    usable = []
    for c in candidates:
        fmt = get_format(resolve(c, records[0]))
        if fmt.supports_head_dim(head_dim):
            usable.append((fmt.bytes_per_token(1, head_dim), c))
    if not usable:  # as kvexec.for_head_dim does for a single format
        usable = [(0.0, "fp16")]
    order = [c for _, c in sorted(usable)]
    return [[resolve(c, rec) for c in order] for rec in records]


@dataclass(frozen=True)
class Measurement:
    """What calibration measures, whatever the tolerance: per layer, every candidate's
    format (allocated widths resolved for that layer) and relative attention error."""

    model: str
    candidates: tuple[str, ...]  # labels, smallest first
    formats: tuple[tuple[str, ...], ...]  # per layer, the candidates resolved, in that order
    errors: tuple[dict[str, float], ...]  # per layer, candidate label -> relative attention error
    tokens: int
    gain: float  # output KL per summed squared attention error
    head_dim: int  # what the candidates' bytes per position are counted at
    shares: tuple[float, ...]  # per layer, min(window, trained context) / trained context; 1 without a window

    def choose(self, tolerance: float) -> Calibration:
        """Per layer, the candidate `allocate` gives it within the budget `tolerance`,
        bytes counted at the trained context; a layer whose share is at most WIDEST_SHARE
        keeps its widest candidate (see module doc)."""
        costs = [[share * get_format(f).bytes_per_token(1, self.head_dim) for f in names]
                 for names, share in zip(self.formats, self.shares)]
        errors = [[e[c] for c in self.candidates] for e in self.errors]
        picks = [len(c) - 1 for c in costs]
        spent = sum(self.gain * errors[i][-1] ** 2 for i, s in enumerate(self.shares) if s <= WIDEST_SHARE)
        chosen_by_budget = [i for i, s in enumerate(self.shares) if s > WIDEST_SHARE]
        allocated = allocate([costs[i] for i in chosen_by_budget], [errors[i] for i in chosen_by_budget],
                             self.gain, tolerance - spent)
        for i, j in zip(chosen_by_budget, allocated):
            picks[i] = j
        chosen = tuple(names[j] for names, j in zip(self.formats, picks))
        return Calibration(self.model, chosen, self.errors, tolerance, self.candidates, self.tokens, self.gain,
                           self.shares)


def allocate(costs: list[list[float]], errors: list[list[float]], gain: float, tolerance: float) -> list[int]:
    """Per layer, which candidate (an index into its `costs` and `errors`, cheapest first)
    keeps the predicted KL, gain x the summed squared errors, within `tolerance` at the
    fewest bytes found: greedy steps up by predicted KL saved per byte, then steps back
    down where the budget allows. Where nothing fits, each layer ends at its least error."""
    picks = [0] * len(costs)
    kl = [gain * e[0] ** 2 for e in errors]
    while sum(kl) > tolerance:
        best = None  # (KL saved per byte, layer, candidate): the first of equals wins
        for i, (cost, err) in enumerate(zip(costs, errors)):
            for j in range(picks[i] + 1, len(cost)):
                saved, spent = kl[i] - gain * err[j] ** 2, cost[j] - cost[picks[i]]
                if saved > 0 and spent > 0 and (best is None or saved / spent > best[0]):
                    best = (saved / spent, i, j)
        if best is None:
            break
        _, i, j = best
        picks[i], kl[i] = j, gain * errors[i][j] ** 2
    for i, err in enumerate(errors):  # an early big step may have left room for a smaller one
        for j in range(picks[i]):
            if costs[i][j] < costs[i][picks[i]] and sum(kl) - kl[i] + gain * err[j] ** 2 <= tolerance:
                picks[i], kl[i] = j, gain * err[j] ** 2
                break
    return picks


def measure(model: nn.Module, tokenizer, identity: str, candidates=CANDIDATES, max_tokens: int = MAX_TOKENS,
            context: int | None = None) -> Measurement:
    """Every candidate's attention error on every layer, and the model's gain (see module
    doc); `context`: the model's trained context (None: every layer's bytes count alike)."""
    ids = list(tokenizer.encode(TEXT.read_text(encoding="utf-8")))[:max_tokens]
    records, ref = record(model, ids, LAYOUT)
    shares = tuple(1.0 if r.window is None or not context else min(r.window, context) / context for r in records)
    per_layer = _ordered(candidates, records)
    errors = layer_errors(records, per_layer, LAYOUT)
    probe = tuple(names[0] for names in per_layer)  # the smallest: the clearest signal, still small errors
    kl = sum(output_kl(model, ids, replace(LAYOUT, layer_formats=probe, sink_tokens=LAYOUT.sink_tokens + shift), ref)
             for shift in range(PROBE_DRAWS)) / PROBE_DRAWS
    gain = kl / max(sum(e[f] ** 2 for e, f in zip(errors, probe)), 1e-30)
    labels = tuple(get_format(c).label for c in per_layer[0])
    rounded = tuple({get_format(c).label: round(e[c], 6) for c in names} for names, e in zip(per_layer, errors))
    return Measurement(identity, labels, tuple(tuple(n) for n in per_layer), rounded, len(ids), float(f"{gain:.6g}"),
                       int(records[0].keys[0].shape[-1]), shares)


def measure_bytes(layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                  max_tokens: int = MAX_TOKENS) -> dict[str, int]:
    """What `measure` holds besides a request's terms (the model, its pages in LAYOUT and
    one chunk's transient, which the planner sizes), by part (bytes): every layer's
    record (float32 queries, keys and values of every position), and ROWS positions'
    output distributions, taken after the body's pass (float32 log-probabilities, their
    negation, the top tokens' int64 indices; numpy, outside MLX) beside the reference."""
    return {"records": layers * max_tokens * (heads + 2 * kv_heads) * head_dim * 4,
            "distributions": ROWS * vocab * (4 + 4 + 8) + max_tokens * TOP * (8 + 4 + 4)}


def calibrate(model: nn.Module, tokenizer, identity: str, candidates=CANDIDATES, tolerance: float = TOLERANCE,
              max_tokens: int = MAX_TOKENS, context: int | None = None) -> Calibration:
    """Measure every candidate on every attention layer and choose per layer (see module doc)."""
    return measure(model, tokenizer, identity, candidates, max_tokens, context).choose(tolerance)


def cache_key(identity: str, candidates) -> str:
    """What a cached measurement is valid for: the model, the procedure and the text."""
    text = hashlib.sha256(TEXT.read_bytes()).hexdigest()
    blob = json.dumps([VERSION, identity, list(candidates), text, asdict(LAYOUT)])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _cache_path(identity: str, cache_dir: Path, candidates) -> Path:
    return Path(cache_dir) / f"kv-calibration-{cache_key(identity, candidates)}.json"


def cached_measurement(identity: str, cache_dir: Path, candidates=CANDIDATES) -> Measurement | None:
    """The measurement cached for this model and these candidates, None if absent or
    unreadable (then it is measured again): what a load checks before it needs the model."""
    try:
        data = json.loads(_cache_path(identity, cache_dir, candidates).read_text(encoding="utf-8"))
        return Measurement(data["model"], tuple(data["candidates"]), tuple(tuple(f) for f in data["formats"]),
                           tuple(data["errors"]), data["tokens"], float(data["gain"]), int(data["head_dim"]),
                           tuple(float(s) for s in data["shares"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_calibration(model: nn.Module, tokenizer, identity: str, cache_dir: Path, candidates=CANDIDATES,
                       tolerance: float = TOLERANCE, context: int | None = None) -> Calibration:
    """`calibrate`, its measurement read from `cache_dir` when this model was measured with
    these candidates before (any tolerance chooses from the same measurement)."""
    found = cached_measurement(identity, cache_dir, candidates)
    if found is None:
        found = measure(model, tokenizer, identity, candidates, context=context)
        path = _cache_path(identity, cache_dir, candidates)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(found), indent=1), encoding="utf-8")
        os.replace(tmp, path)  # readers see the old file or the whole new one
    return found.choose(tolerance)


def calibrated_config(config: KVConfig, calibration: Calibration) -> KVConfig:
    """`config` with each attention layer's pages in its calibrated format."""
    return replace(config, layer_formats=calibration.formats)

"""Loading a model for the engine: weights read lazily (PhaseSwap takes them one
component at a time), KVExec's page format for the model's head_dim,
and where a model's offloaded components are kept on disk."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

import kvexec
from justfit.model import adapter
from justfit.config import EngineConfig
from justfit.model.gguf.cache import RequantOptions, cache_root
from justfit.memory import trim_heap
from justfit.model.models import LoadedModel, load, weight_files
from justfit.planning.cost_model import attention_shape
from kvexec import KVConfig
from kvexec.calibrate import (CANDIDATES, TOLERANCE, Calibration, cached_calibration, cached_measurement,
                              calibrated_config)
from kvexec.formats import CALIBRATED, needs_model
from phaseswap.native import available as native_available
from phaseswap.policy import ResidencyPolicy

log = logging.getLogger("justfit.loader")


def load_lazily(model: str | None, config: EngineConfig) -> LoadedModel:
    """`model` (a name, folder or GGUF file) with its weights not read yet."""
    loaded = load(model, RequantOptions(bits=config.gguf_bits, embed_bits=config.gguf_embed_bits), lazy=True)
    trim_heap()  # what loading the tokenizer freed goes back to the system
    return loaded


def kv_for_model(model: nn.Module, model_config: dict, kv: KVConfig | None,
                 calibration: Calibration | None = None) -> KVConfig | None:
    """`kv` (None: mlx-lm's own cache) with its calibrated per-layer formats, if any,
    adapted to the model's head_dim. The seam that routes attention to KVExec is
    justfit.model.adapter's to install."""
    if kv is None:
        return None
    if calibration is not None:
        kv = calibrated_config(kv, calibration)
    return kvexec.for_head_dim(kv, attention_shape(model, model_config)[2])


def calibration_candidates(kv: KVConfig | None) -> tuple[str, ...]:
    """The page formats calibration measures for `kv` ("calibrated": every candidate; an
    allocated format: that one); none where `kv` needs no calibration."""
    if kv is None or kv.layer_formats or not needs_model(kv.format):
        return ()
    return CANDIDATES if kv.format == CALIBRATED else (kv.format,)


def calibration_dir() -> Path:
    """Where calibration measurements are cached: beside the converted-model cache."""
    return cache_root().parent / "calibration"


def kv_calibration(model: str | None, config: EngineConfig, identity: Callable[[], str]) -> Calibration | None:
    """The per-layer page formats `config.kv` asks the model for ("calibrated", or an
    allocated format's widths), from the cache or measured on a second, lazily loaded
    copy of the model that is dropped afterwards (the engine's own copy stays unread);
    None when the format needs no calibration."""
    kv = config.kv
    candidates = calibration_candidates(kv)
    if not candidates:
        return None
    tolerance = TOLERANCE if kv.calibration_tolerance is None else kv.calibration_tolerance
    name, cache_dir = identity(), calibration_dir()
    found = cached_measurement(name, cache_dir, candidates)
    if found is not None:  # the usual load: no second copy of the model
        return found.choose(tolerance)
    # a one-time wait worth naming (seconds to a minute on a CPU)
    log.info("measuring which KV page formats this model's layers take (once per model, then cached)")
    probe = load_lazily(model, config)
    # On the CPU each layer runs its chunks dense, just in time, as the engine's prefill
    # does, and a tied head every position's logits through the native kernel where it
    # is built: MLX's CPU product on 4- or 5-bit weights made calibration several times slower.
    cpu = mx.default_device() == mx.cpu
    adapted = adapter.install(probe.model, paged=True, native=False,
                              policy=("cpu-native" if native_available() else "cpu-compact") if cpu else None)
    phase = adapted.swap.phase("prefill") if adapted.swap is not None else contextlib.nullcontext()
    try:
        with phase:
            context = probe.config.get("text_config", probe.config).get("max_position_embeddings")
            return cached_calibration(probe.model, probe.tokenizer, name, cache_dir, candidates, tolerance, context)
    finally:
        # the probe's modules and its swap registry refer to each other: only the cycle
        # collector frees them, and it may not run for a long while
        del probe, adapted, phase
        gc.collect()
        mx.clear_cache()
        trim_heap()


def offload_dir(loaded: LoadedModel, policy: ResidencyPolicy) -> Path:
    """Where offloaded components of this model, in this policy's form, are kept."""
    source = f"{loaded.path or loaded.name}"
    source += "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in weight_files(loaded.path))
    key = hashlib.sha256(f"{source}|{policy.resident}|{policy.fp32}".encode()).hexdigest()[:16]
    # "offloaded", the glossary's word for weights on disk. Earlier versions used "stream";
    # nothing is read back from it across runs (each run writes its files on first
    # offload), so it is left alone: a running older server still uses it.
    return cache_root() / "offloaded" / key

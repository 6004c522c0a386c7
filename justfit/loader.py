"""Loading a model for the engine: weights read lazily (PhaseSwap takes them one
component at a time), KVExec installed with a page format for the model's head_dim,
and where a model's offloaded components are kept on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.nn as nn

import kvexec
from justfit.config import EngineConfig
from justfit.gguf.convert import RequantOptions, cache_root
from justfit.memory import trim_heap
from justfit.models import LoadedModel, load, weight_files
from justfit.planner import attention_shape
from kvexec import KVConfig
from phaseswap.policy import ResidencyPolicy


def load_lazily(model: str | None, config: EngineConfig) -> LoadedModel:
    """`model` (a name, folder or GGUF file) with its weights not read yet."""
    loaded = load(model, RequantOptions(bits=config.gguf_bits, embed_bits=config.gguf_embed_bits), lazy=True)
    trim_heap()  # what loading the tokenizer freed goes back to the system
    return loaded


def install_kv(model: nn.Module, model_config: dict, kv: KVConfig | None) -> KVConfig | None:
    """Route `model`'s attention through KVExec (unless `kv` is None: mlx-lm's own
    cache) and return `kv` adapted to the model's head_dim."""
    if kv is None:
        return None
    kvexec.install(model)
    return kvexec.for_head_dim(kv, attention_shape(model, model_config)[2])


def offload_dir(loaded: LoadedModel, policy: ResidencyPolicy) -> Path:
    """Where offloaded components of this model, in this policy's form, are kept."""
    source = f"{loaded.path or loaded.name}"
    source += "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in weight_files(loaded.path))
    key = hashlib.sha256(f"{source}|{policy.resident}|{policy.fp32}".encode()).hexdigest()[:16]
    return cache_root() / "stream" / key  # "stream": the directory name existing caches use

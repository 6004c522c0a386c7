"""Save and restore an engine's conversation state through StateTrans snapshots."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

from justfit.models import weight_files
from statetrans import (SnapshotError, capture, load_snapshot, rebuild, save_snapshot, snapshot_bytes,
                        state_bytes)


@dataclass
class StateIO:
    path: str
    tokens: int
    state_bytes: int  # arrays as held in memory
    file_bytes: int  # on disk (arrays + manifest)
    seconds: float
    extra: dict = field(default_factory=dict)  # what the saver attached (chat: the transcript)

    @property
    def mb_per_s(self) -> float:
        return self.file_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def model_identity(engine) -> str:
    """Hash of the model's config and weight files' names and sizes: a snapshot only
    continues on the model that computed it."""
    h = hashlib.sha256(json.dumps(engine.model_config, sort_keys=True, default=str).encode())
    for f in weight_files(engine.path):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    if engine.path is None:
        h.update(str(engine.name).encode())
    return h.hexdigest()[:32]


def _kv(engine) -> dict | None:
    return asdict(engine.config.kv) if engine.config.kv is not None else None


def save_state(engine, path: str, extra: dict | None = None) -> StateIO:
    cache, tokens = engine._conv.cache, list(engine._conv.tokens)
    if cache is None or not tokens:
        raise ValueError("nothing to save: the conversation holds no state yet")
    start = time.perf_counter()
    arrays, layers = capture(cache)
    meta = {"model": model_identity(engine), "model_name": engine.name, "kv": _kv(engine),
            "policy": engine.policy.name, "tokens": tokens, "layers": layers, "extra": extra or {}}
    written = save_snapshot(path, arrays, meta)
    return StateIO(str(path), len(tokens), state_bytes(arrays), written, time.perf_counter() - start)


def load_state(engine, path: str) -> StateIO:
    """Replace the engine's conversation with the snapshot's; on any error the
    engine's current state is untouched."""
    start = time.perf_counter()
    arrays, manifest = load_snapshot(path)
    if manifest.get("model") != model_identity(engine):
        raise SnapshotError(f"{path}: saved with model {manifest.get('model_name')!r} "
                            f"({manifest.get('model')}), not this engine's {engine.name!r}")
    if manifest.get("kv") != _kv(engine):
        fmt = (manifest.get("kv") or {}).get("format", "mlx-lm")
        raise SnapshotError(f"{path}: saved with KV format {fmt}, this engine uses "
                            f"{engine.config.kv.format if engine.config.kv else 'mlx-lm'} (or other KV settings)")
    try:
        cache = rebuild(arrays, manifest["layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{path}: inconsistent snapshot ({e})") from None
    tokens = [int(t) for t in manifest["tokens"]]
    if len(cache) != len(engine.new_cache()) or any(getattr(c, "offset", len(tokens)) != len(tokens) for c in cache):
        raise SnapshotError(f"{path}: state does not match its tokens or this model's layers")
    engine._set_conversation(cache, tokens)
    return StateIO(str(path), len(tokens), state_bytes(arrays), snapshot_bytes(path),
                   time.perf_counter() - start, manifest.get("extra") or {})

"""Save and restore an engine's stored states as StateTrans snapshots."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

from justfit.models import weight_files
from statetrans import snapshot_bytes


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


def state_identity(engine) -> dict:
    """What a stored state belongs to: the model, its KV settings and weight forms."""
    # As JSON holds it (tuples come back as lists), to compare with a saved manifest.
    kv = json.loads(json.dumps(asdict(engine.config.kv))) if engine.config.kv is not None else None
    return {"model": model_identity(engine), "model_name": engine.name, "kv": kv, "policy": engine.policy.name}


def export_state(engine, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
    states = engine.states
    if session is not None and session not in states.sessions:
        raise KeyError(f"no session {session!r}")
    entry = states.entries[states.sessions[session]] if session is not None else states.last
    if entry is None or not entry.tokens:
        raise ValueError("nothing to save: the conversation holds no state yet")
    start = time.perf_counter()
    held, written = states.export(entry, path, extra)
    return StateIO(str(path), len(entry.tokens), held, written, time.perf_counter() - start)


def import_state(engine, path: str, session: str | None = None) -> StateIO:
    """Store the snapshot's state as the latest conversation (or `session`'s); on any
    error nothing changes."""
    start = time.perf_counter()
    cache, manifest, held = engine.states.read(path)
    engine.states.put([int(t) for t in manifest["tokens"]], cache, session, manifest.get("sampler"))
    return StateIO(str(path), len(manifest["tokens"]), held, snapshot_bytes(path),
                   time.perf_counter() - start, manifest.get("extra") or {})

"""Save and restore an engine's stored states as StateTrans snapshots (one process's:
a layer pipeline's runner saves its own, justfit.engine.pipeline_runner), and name
sessions."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from justfit.model.models import LoadedModel, weight_files
from kvexec import KVConfig
from statetrans import save_snapshot, snapshot_bytes, state_bytes
from statetrans.identity import weights_digest


@dataclass
class StateIO:
    """What a save or restore of a stored state moved, and how long it took."""

    path: str
    tokens: int
    state_bytes: int  # arrays as held in memory
    file_bytes: int  # on disk (arrays + manifest)
    seconds: float
    extra: dict = field(default_factory=dict)  # what the saver attached (chat: the transcript)

    @property
    def mb_per_s(self) -> float:
        """File throughput of the save or restore, in MB per second."""
        return self.file_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def state_root(configured: str | None = None) -> Path:
    """The state directory: `configured`, else $JUSTFIT_STATE_DIR, else beside the
    model cache."""
    from justfit.model.gguf.cache import cache_root

    return Path(configured or os.environ.get("JUSTFIT_STATE_DIR") or cache_root().parent / "state")


def model_identity(engine, cache_dir: Path | None = None) -> str:
    """Hash of the model's config and weight files' content (sha256, remembered in
    `cache_dir` by path, size and mtime): a snapshot only continues on the weights
    that computed it."""
    return folder_identity(engine.model_config, engine.path, engine.name, cache_dir)


def folder_identity(config: dict, path: Path | None, name: str, cache_dir: Path | None = None) -> str:
    """`model_identity` of a model by its config, folder (None: a hub id) and name, loaded or not."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(weights_digest(weight_files(path), cache_dir).encode())
    if path is None:
        h.update(str(name).encode())
    return h.hexdigest()[:32]


def state_identity(loaded: LoadedModel, kv: KVConfig | None, policy: str, cache_dir: Path | None = None) -> dict:
    """What a stored state belongs to: the model, its KV settings and weight forms (`policy`'s name)."""
    # As JSON holds it (tuples come back as lists), to compare with a saved manifest.
    kv_json = json.loads(json.dumps(asdict(kv))) if kv is not None else None
    return {"model": folder_identity(loaded.config, loaded.path, loaded.name, cache_dir), "model_name": loaded.name,
            "kv": kv_json, "policy": policy}


def export_state(engine, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
    """Save the latest conversation's state (or `session`'s) as a snapshot at `path`."""
    states = engine.states
    if session is not None and session not in states.sessions:
        raise KeyError(f"no session {session!r}")
    entry = states.entries[states.sessions[session]] if session is not None else states.last
    if entry is None or not entry.tokens:
        raise ValueError("nothing to save: the conversation holds no state yet")
    start = time.perf_counter()
    arrays, layers = states.arrays(entry)
    meta = {**states.identity, "tokens": list(entry.tokens), "layers": layers, "session": entry.session,
            "sampler": entry.sampler, "extra": extra or {}}
    written = save_snapshot(path, arrays, meta)
    return StateIO(str(path), len(entry.tokens), state_bytes(arrays), written, time.perf_counter() - start)


def import_state(engine, path: str, session: str | None = None) -> StateIO:
    """Store the snapshot's state as the latest conversation (or `session`'s); on any
    error nothing changes."""
    start = time.perf_counter()
    cache, manifest, held = engine.states.read(path)
    engine.states.put([int(t) for t in manifest["tokens"]], cache, session, manifest.get("sampler"))
    return StateIO(str(path), len(manifest["tokens"]), held, snapshot_bytes(path),
                   time.perf_counter() - start, manifest.get("extra") or {})


def save_session(engine, name: str, extra: dict | None = None) -> StateIO:
    """Name the latest conversation `name`: a session, written through to the state
    directory now and at every later turn of it; `extra` (JSON) is kept beside it."""
    engine.runner.refuse_session(name)
    states = engine.states
    entry = states.session_entry(name) if states.last is None else states.last
    if entry is None or not entry.tokens:
        raise ValueError("nothing to save: the conversation holds no state yet")
    start = time.perf_counter()
    if entry.session != name:
        entry = states.keep_as(entry, name)
    states.flush()
    if extra is not None:
        states.store.write_extra(name, extra)
    return StateIO(str(states.store.folder(name)), len(entry.tokens), entry.nbytes, entry.disk_bytes,
                   time.perf_counter() - start, extra or {})


def resume_session(engine, name: str) -> StateIO | None:
    """Session `name` from the state directory (the next request naming it prefills
    only what is new), with what was kept beside it; None if there is none."""
    engine.runner.refuse_session(name)
    start = time.perf_counter()
    entry = engine.states.session_entry(name)
    if entry is None:
        return None
    return StateIO(str(engine.states.store.folder(name)), len(entry.tokens), entry.nbytes, entry.disk_bytes,
                   time.perf_counter() - start, engine.states.store.read_extra(name))

"""A layer pipeline's state saved and restored across its ranks.

Each rank writes its share (its layers' pages, its stand-ins' positions) as a StateTrans
snapshot on its own disk, `PATH/rank{R}-{GEN}`, under a generation rank 0 names. Rank
0's part, `PATH/rank0`, is written last and lists every other part's manifest digest
and the split: it is the commit point. A crash or a failed rank before it leaves the
previous generation whole. A restore checks every part against rank 0's list and the
split, and installs the state on every rank or on none.

Rank 0 announces each operation down the chain (a header, then a JSON payload); every
rank answers in one all_gather: whether it succeeded and its part's digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx

from justfit.pipeline.stand_ins import Position, WindowPosition
from statetrans import SnapshotError, load_snapshot, save_snapshot, snapshot_bytes, state_bytes
from statetrans.state import capture, rebuild

SAVE, LOAD, COMMIT = 4, 5, 6  # header ops beside justfit.pipeline.stand_ins' FORWARD, RESET, STOP
STATE_OPS = (SAVE, LOAD, COMMIT)
_DIGEST = 32


def _part(path: str, rank: int, gen: str = "") -> Path:
    return Path(path).expanduser() / (f"rank{rank}-{gen}" if rank else "rank0")


def _manifest_digest(folder: Path) -> bytes:
    return hashlib.sha256((folder / "manifest.json").read_bytes()).digest()


def announce(link, op: int, payload: dict) -> None:
    """Rank 0: send `op` and its payload to rank 1 (each rank passes them on)."""
    data = mx.array(list(json.dumps(payload).encode()), dtype=mx.uint8)
    link.send(mx.array([op, data.size], dtype=mx.int32), 1)
    link.send(data, 1)


def receive(link, n: int) -> dict:
    """Rank r > 0, after a state op's header (already passed on): its payload, passed
    on down the chain too."""
    rank = link.rank()
    data = link.recv_like(mx.zeros((n,), dtype=mx.uint8), rank - 1)
    if rank < link.size() - 1:
        link.send(data, rank + 1)
    return json.loads(bytes(data.tolist()).decode())


def _answers(link, ok: bool, digest: bytes = b"\0" * _DIGEST) -> list[tuple[bool, bytes]]:
    mine = mx.array([int(ok)] + list(digest), dtype=mx.uint8)
    rows = mx.distributed.all_gather(mine, group=link.group).reshape(link.size(), -1).tolist()
    return [(bool(r[0]), bytes(r[1:])) for r in rows]


def capture_share(cache: list) -> tuple[dict[str, mx.array], dict]:
    """This rank's share of a pipeline cache: its own layers' arrays and metadata, and
    each stand-in's position (a sliding one's ring state)."""
    held = [i for i, c in enumerate(cache) if not isinstance(c, Position)]
    arrays, layers = capture([cache[i] for i in held])
    shadows = {}
    for i, c in enumerate(cache):
        if isinstance(c, WindowPosition):
            size, ring = c.place
            shadows[i] = {"offset": c.offset, "size": size, "ring": ring}
        elif isinstance(c, Position):
            shadows[i] = {"offset": c.offset}
    return arrays, {"held": held, "layers": layers, "shadows": shadows}


def rebuild_share(arrays: dict[str, mx.array], share: dict, fresh: list) -> list:
    """The cache `capture_share` described, on `fresh` (this rank's new cache)."""
    cache = list(fresh)
    if sorted(share["held"] + [int(i) for i in share["shadows"]]) != list(range(len(cache))):
        raise SnapshotError("the part's layers do not match this rank's")
    for i, layer in zip(share["held"], rebuild(arrays, share["layers"])):
        if isinstance(cache[i], Position):
            raise SnapshotError(f"the part holds layer {i}, which this rank does not")
        cache[i] = layer
    for key, s in share["shadows"].items():
        c = cache[int(key)]
        if not isinstance(c, Position):
            raise SnapshotError(f"the part lacks layer {key}, which this rank holds")
        if isinstance(c, WindowPosition):
            c.restore(s["size"], s["ring"])
        c.offset = s["offset"]
    return cache


def _write_part(folder: Path, cache: list, meta: dict) -> int:
    arrays, share = capture_share(cache)
    save_snapshot(folder, arrays, {**meta, "share": share})
    return state_bytes(arrays)


def save(pipeline, run, path: str, meta: dict) -> tuple[int, int]:
    """Rank 0 of `pipeline` (justfit.pipeline.layers.Pipeline): write `run`'s live state
    (a PipelineRun's) at `path` on every rank; (bytes written here, state bytes here).
    Raises OSError naming the ranks that could not write (the previous generation stays
    whole)."""
    if run.live is None:
        raise ValueError("nothing to save: the conversation holds no state yet")
    held, cache, sampler = run.live
    link, starts = pipeline.link, list(pipeline.split.starts)
    gen = os.urandom(6).hex()
    common = {**meta, "positions": len(held), "pipeline": {"starts": starts, "generation": gen}}
    announce(link, SAVE, {"path": str(path), "meta": common})
    answers = _answers(link, True)
    failed = [r for r, (ok, _) in enumerate(answers) if not ok]
    if failed:
        _commit(link, path, None, gen)
        raise OSError(f"ranks {failed} could not write their part of {path}; the previous state there is kept")
    parts = {str(r): d.hex() for r, (_, d) in enumerate(answers) if r}
    try:  # the commit point
        nbytes = _write_part(_part(path, 0), cache, {**common, "tokens": list(held), "sampler": sampler,
                                                     "parts": parts, "pipeline": {**common["pipeline"], "rank": 0}})
    except BaseException:
        _commit(link, path, None, gen)
        raise
    _commit(link, path, gen, None)
    return snapshot_bytes(_part(path, 0)), nbytes


def _commit(link, path: str, keep: str | None, drop: str | None) -> None:
    """Every rank drops its parts of other generations than `keep` (or of `drop`)."""
    announce(link, COMMIT, {"path": str(path), "keep": keep, "drop": drop})
    _answers(link, True)


def load(pipeline, run, new_cache, path: str, identity: dict) -> tuple[dict, int]:
    """Rank 0 of `pipeline`: restore the state saved at `path` on every rank or on none
    (`run.live` then holds it; `new_cache()` makes this rank's fresh cache); the manifest
    of rank 0's part and its state bytes. Raises SnapshotError saying which part is
    wrong."""
    arrays, manifest = load_snapshot(_part(path, 0))
    pipe = manifest.get("pipeline") or {}
    starts = list(pipeline.split.starts)
    if pipe.get("starts") != starts:
        raise SnapshotError(f"{path}: saved by a pipeline split at layers {pipe.get('starts')}, "
                            f"this one splits at {starts}")
    if {k: manifest.get(k) for k in identity} != identity:
        raise SnapshotError(f"{path}: saved for another model or KV settings")
    cache = rebuild_share(arrays, manifest["share"], new_cache())
    link = pipeline.link
    announce(link, LOAD, {"path": str(path), "generation": pipe["generation"], "parts": manifest["parts"],
                           "starts": starts, "identity": identity})
    answers = _answers(link, True)
    failed = [r for r, (ok, _) in enumerate(answers) if not ok]
    if failed:
        raise SnapshotError(f"{path}: the part of rank(s) {failed} is missing, damaged or from another "
                            "save; no rank's state changed")
    run.live = ([int(t) for t in manifest["tokens"]], cache, manifest.get("sampler") or {})
    return manifest, state_bytes(arrays)


def follower_op(pipeline, new_cache, op: int, payload: dict, cache: list) -> list:
    """Rank r > 0 of `pipeline`: carry out rank 0's state operation (`new_cache()` makes
    this rank's fresh cache); the cache to go on with."""
    link, rank = pipeline.link, pipeline.rank
    path = payload["path"]
    if op == COMMIT:  # drop this rank's other generations (or the failed one)
        for p in Path(path).expanduser().glob(f"rank{rank}-*"):
            if p.name != f"rank{rank}-{payload['keep']}" and (payload["keep"] or p.name.endswith(payload["drop"])):
                shutil.rmtree(p, ignore_errors=True)
        _answers(link, True)
        return cache
    if op == SAVE:
        meta = payload["meta"]
        folder = _part(path, rank, meta["pipeline"]["generation"])
        try:
            _write_part(folder, cache, {**meta, "pipeline": {**meta["pipeline"], "rank": rank}})
            digest = _manifest_digest(folder)
        except Exception:  # noqa: BLE001  (any failure: rank 0 waits for this rank's answer)
            digest = None
        _answers(link, digest is not None, digest or b"\0" * _DIGEST)
        return cache
    loaded = None
    try:  # LOAD: this rank's part, checked against rank 0's list, the split and the model
        folder = _part(path, rank, payload["generation"])
        if _manifest_digest(folder).hex() != payload["parts"].get(str(rank)):
            raise SnapshotError("another save's part")
        arrays, manifest = load_snapshot(folder)
        if manifest["pipeline"]["starts"] != payload["starts"] or list(pipeline.split.starts) != \
                payload["starts"] or {k: manifest.get(k) for k in payload["identity"]} != payload["identity"]:
            raise SnapshotError("another split or model")
        loaded = rebuild_share(arrays, manifest["share"], new_cache())
    except Exception:  # noqa: BLE001  (any failure: every rank keeps its state)
        loaded = None
    answers = _answers(link, loaded is not None)
    return loaded if all(ok for ok, _ in answers) else cache


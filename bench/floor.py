"""The decode memory floor: a decode step reads every weight it multiplies by and the KV
it attends over, so bytes read per token over the machine's streaming read bandwidth
bounds the rate. `bench.speed` reports each row's decode as a fraction of it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


def read_bandwidth(nbytes: int = 512 * 2**20, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes per second of a plain streaming read (numpy sums over uint64 slices, one
    slice per core: numpy releases the GIL), the best of `repeats` passes."""
    import os

    import numpy as np

    threads = threads or os.cpu_count() or 1
    data = np.ones(nbytes // 8, dtype=np.uint64)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def justfit_read_bytes(engine, context: int) -> int:
    """Bytes one JustFit decode step at `context` positions reads: every layer and the
    head in their resident form (the embedding only where it is the tied head), and
    the KV pages the planner holds for `context`."""
    comps = engine.swap.registry.components.values()
    tied = not any(c.kind == "head" for c in comps)
    weights = sum(c.nbytes for c in comps if c.kind != "embed" or tied)
    return weights + engine.planner.footprint(context).kv


def stock_read_bytes(model, cache: list) -> int:
    """Bytes one mlx-lm decode step reads: every parameter but a lookup-only embedding
    (a tied one is the head), and the cache."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    tied = not any(k.startswith("lm_head") for k, _ in params)
    weights = sum(v.nbytes for k, v in params if tied or "embed_tokens" not in k)
    return weights + sum(c.nbytes for c in cache)


def floor_fields(decode_tps: float, read_bytes: int, bandwidth: float) -> dict:
    """A row's floor figures: MiB read per token, the floor rate, and the fraction of it."""
    floor = bandwidth / read_bytes
    return {"read_mib_per_token": round(read_bytes / 2**20, 1), "floor_tps": round(floor, 1),
            "floor_fraction": round(decode_tps / floor, 3)}


def disk_read_bandwidth(nbytes: int = 512 * 2**20, folder: str | None = None) -> float:
    """Bytes per second of a cold sequential read from disk: a file of `nbytes` written
    in `folder` (the temporary folder), flushed and dropped from the page cache, read
    in 8 MiB pieces, each dropped again once read (as KV pages on disk are read)."""
    import os
    import tempfile

    with tempfile.TemporaryFile(dir=folder) as f:
        fd, piece = f.fileno(), os.urandom(8 * 2**20)
        for at in range(0, nbytes, len(piece)):
            os.pwrite(fd, piece, at)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(len(piece))
        start = time.perf_counter()
        for at in range(0, nbytes, len(piece)):
            os.preadv(fd, [buf], at)
            os.posix_fadvise(fd, at, len(piece), os.POSIX_FADV_DONTNEED)
        return nbytes / (time.perf_counter() - start)

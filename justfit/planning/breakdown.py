"""The whole process's memory part by part, each part measured: what `justfit fit` and
`/v1/justfit/status` show, and what a whole-process budget is spent on.

Each row says how it is measured (`HOW`). Three parts leave no trace to read later, so
the engine measures them once, at load, as the change in the process's anonymous
resident memory (RssAnon, less MLX's active bytes) around their making, with the C heap
trimmed before and after (`LoadMarks`): the interpreter and the modules imported before
the model, the tokenizer, and BLAS's thread buffers. The rest are read when asked:
library code mapped from files (RssFile), MLX's bytes (the weights' components, the
stored states' pages and hot windows, what else MLX holds, its buffer cache), and the
Python objects of the stored states (token lists, prefix trie) by `sys.getsizeof`.
What no row explains is `unaccounted` (heap fragments, thread stacks, Python objects
made after load), so the rows always add up to RSS; how small it stays is the test.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Callable, TypeVar

import mlx.core as mx

from justfit.memory import format_size, peak_rss_bytes, proc_status_bytes, rss_bytes, trim_heap

T = TypeVar("T")

HOW = {
    "libraries": "library and interpreter code mapped from files, now (RssFile)",
    "modules": "anonymous memory when the engine began loading, less MLX's: the interpreter's heap, the "
               "modules imported and what else the process held before the model (RssAnon)",
    "tokenizer": "RssAnon change around the tokenizer's load, heap trimmed (a GGUF model's; 0 where mlx-lm's "
                 "loader made it, then in unaccounted)",
    "blas": "RssAnon change, less MLX's, around a first matrix product at load: BLAS's thread buffers",
    "weights": "MLX bytes of the resident weight components",
    "pages": "MLX bytes of the KV pages (sinks and segments) of the stored states and the running request",
    "hot_window": "MLX bytes of their full-precision hot windows",
    "mlx_other": "MLX active bytes besides weights and stored states (working copies, transients held now)",
    "mlx_cache": "MLX's buffer cache (freed buffers kept for reuse)",
    "token_lists": "sys.getsizeof of the stored states' Python objects (token lists, prefix trie)",
    "unaccounted": "RSS less every row above (heap fragments, thread stacks, later Python objects)",
}


def anon_bytes() -> int:
    """The process's anonymous resident memory (Linux RssAnon; elsewhere RSS, which
    then also counts mapped files)."""
    anon = proc_status_bytes("RssAnon")
    return rss_bytes() if anon is None else anon


def file_bytes() -> int:
    """The process's resident pages mapped from files: library and interpreter code
    (Linux RssFile; 0 elsewhere, where `anon_bytes` counts them)."""
    return proc_status_bytes("RssFile") or 0


def outside_anon() -> int:
    """Anonymous resident memory besides MLX's buffers (active, and freed ones its cache
    keeps), after a heap trim."""
    trim_heap()
    return anon_bytes() - mx.get_active_memory() - mx.get_cache_memory()


def measured(make: Callable[[], T]) -> tuple[T, int]:
    """`make()` and the anonymous memory besides MLX it left resident (never below 0)."""
    before = outside_anon()
    made = make()
    return made, max(0, outside_anon() - before)


def blas_warm_up(width: int) -> int:
    """Bytes BLAS's first product leaves resident: a float32 product of the shape a
    prefill chunk of `width`-wide activations runs (BLAS sizes its per-thread buffers
    on first use; the product's own arrays are MLX's and are freed)."""
    def product():
        a = mx.ones((128, width), dtype=mx.float32)
        mx.eval(a @ mx.ones((width, width), dtype=mx.float32))
    return measured(product)[1]


@dataclass(frozen=True)
class LoadMarks:
    """What the engine measured once at load (see the module doc), in bytes."""

    modules: int = 0
    tokenizer: int = 0
    blas: int = 0


def _py_bytes(root: object) -> int:
    """sys.getsizeof summed over the Python objects reachable from `root` through
    containers and the objects of statetrans's own classes; MLX and numpy arrays,
    modules, classes and functions not followed (counted elsewhere, or shared)."""
    seen, stack, total = set(), [root], 0
    followed = (list, tuple, dict, set, frozenset)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (mx.array, type(sys))) or callable(obj):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        kind = type(obj)
        if isinstance(obj, followed) or kind.__module__.startswith("statetrans"):
            stack.extend(gc.get_referents(obj))
    return total


def _state_kv(engine, live: list) -> tuple[int, int]:
    """(pages, hot windows) in bytes of the states held in memory and of `live` (the
    running requests' layers)."""
    caches = [e.cache for e in list(engine.states.entries.values()) if e.cache is not None]
    stored = {id(layer) for cache in caches for layer in cache}
    caches.append([layer for layer in live if id(layer) not in stored])
    total = hot = 0
    for cache in caches:
        total += sum(getattr(layer, "nbytes", 0) for layer in cache)
        for layer in cache:
            window = getattr(getattr(layer, "store", None), "hot", None)
            for room in (getattr(window, "keys_room", None), getattr(window, "values_room", None)):
                hot += room.nbytes if room is not None else 0
    return total - hot, hot


def process_breakdown(engine, live: list | None = None, last=None) -> dict:
    """The engine's process now, part by part (bytes, keys as in `HOW`), adding up to
    `rss`; with the process's and MLX's peaks beside (not part of the sum). `live`: the
    running requests' cache layers; `last`: the last request's GenerationStats."""
    trim_heap()
    marks: LoadMarks = getattr(engine, "load_marks", None) or LoadMarks()
    weights = engine.swap.registry.resident_bytes()
    pages, hot = _state_kv(engine, live or [])
    active = mx.get_active_memory()
    parts = {
        "libraries": file_bytes(), "modules": marks.modules, "tokenizer": marks.tokenizer, "blas": marks.blas,
        "weights": weights, "pages": pages, "hot_window": hot,
        "mlx_other": max(0, active - weights - pages - hot), "mlx_cache": mx.get_cache_memory(),
        "token_lists": _py_bytes(engine.states),
    }
    rss = rss_bytes()
    parts["unaccounted"] = rss - sum(parts.values())
    memory = getattr(last, "memory", None)
    peaks = {"process": peak_rss_bytes(), "mlx": mx.get_peak_memory(),  # high-water marks since start
             "transient": memory.transient_peak if memory is not None else None}  # the last request's
    return {"parts": parts, "rss": rss, "outside_mlx": rss - active - parts["mlx_cache"], "peaks": peaks,
            "how": HOW}


def format_breakdown(b: dict) -> list[str]:
    """The breakdown as lines of text: a row per part, its size and how it is measured."""
    rss = b["rss"]
    lines = [f"process now: {format_size(rss)} resident, {format_size(b['outside_mlx'])} of it outside MLX"]
    for name, value in b["parts"].items():
        lines.append(f"  {name.replace('_', ' '):<12} {format_size(value):>11} {100 * value / rss:5.1f}%  "
                     f"{b['how'][name]}")
    p = b["peaks"]
    transient = "" if p["transient"] is None else f"; the last request's MLX transient {format_size(p['transient'])}"
    lines.append(f"  peaks since start (not in the sum): process {format_size(p['process'])}, "
                 f"MLX {format_size(p['mlx'])}{transient}")
    return lines

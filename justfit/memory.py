"""Memory accounting: sizes, budgets and what the process is using right now."""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
import psutil
from mlx.utils import tree_flatten

from justfit import runtime

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int | float) -> int:
    """'2GiB', '1.5 GB', '512MiB', '1e9' -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (try 2GiB, 512MiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int | float) -> str:
    """A byte count as readable text, in B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def tree_bytes(tree) -> int:
    """Bytes of the MLX arrays in a tree."""
    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters."""
    return tree_bytes(model.parameters())


def cache_bytes(cache: list | None) -> int:
    """Bytes a cache list holds (the layers that report them)."""
    return sum(getattr(c, "nbytes", 0) for c in cache or [])


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system. Loading leaves many behind:
    transformers' fast tokenizer for Gemma 3's 262K vocabulary frees hundreds of MiB
    of temporaries that glibc would otherwise keep. No-op off glibc."""
    libc = runtime.glibc()
    if libc is not None:
        libc.malloc_trim(0)


def rss_bytes() -> int:
    """This process's resident set size now."""
    return psutil.Process().memory_info().rss


def proc_status_bytes(field: str) -> int | None:
    """A size field of this process's /proc/self/status (e.g. VmHWM, RssAnon) in bytes;
    None off Linux or where the kernel has no such field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's whole high-water mark since it started. On Linux the kernel's
    VmHWM: ru_maxrss also counts the peak of the process this one was forked from (the
    copied address space's mark survives exec), so a benchmark worker would report its
    harness's peak wherever that was higher."""
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class MemoryReport:
    """What a generation held: weights, KV, stored states, MLX and process memory."""

    weights: int
    kv: int
    mlx_active: int
    mlx_peak: int
    transient_peak: int  # MLX peak above what weights, KV and stored states hold
    rss: int
    rss_peak: int
    states: int = 0  # other requests' and sessions' states in the memory tier

    def as_dict(self) -> dict[str, int]:
        """The report as a plain dict."""
        return asdict(self)

    def summary(self) -> str:
        """One readable line: weights, KV, transient peak, stored states, MLX and process peaks."""
        return (f"weights {format_size(self.weights)}, KV {format_size(self.kv)}, "
                f"transient peak {format_size(self.transient_peak)}, stored states {format_size(self.states)}, "
                f"MLX peak {format_size(self.mlx_peak)}, process peak {format_size(self.rss_peak)}")


def memory_report(weights: nn.Module | int, cache: list | None = None,
                  peak: int | None = None, states: int = 0) -> MemoryReport:
    """`weights`: a model (all its parameters count) or the bytes resident."""
    weights = weights if isinstance(weights, int) else weight_bytes(weights)
    kv = cache_bytes(cache)
    peak = mx.get_peak_memory() if peak is None else peak
    return MemoryReport(
        weights=weights, kv=kv, mlx_active=mx.get_active_memory(), mlx_peak=peak,
        transient_peak=max(0, peak - weights - kv - states), rss=rss_bytes(), rss_peak=peak_rss_bytes(),
        states=states,
    )

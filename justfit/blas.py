"""Optimized BLAS for MLX's CPU backend.

The `mlx[cpu]` wheel links a slow reference BLAS. Loading a system OpenBLAS with
RTLD_GLOBAL *before* `mlx.core` is imported makes MLX resolve its BLAS symbols there
instead, for far faster GEMMs (`justfit bench blas` measures both).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CANDIDATES = (  # the OpenMP build first: it shares the native kernels' OpenMP threads
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

_loaded: str | None = None
# OpenBLAS chooses its kernels by CPU model when it loads; a model newer than the library
# gets its generic SSE3 kernels ("Prescott"). Skylake-X's kernels need these flags.
_SKYLAKEX_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def find_openblas() -> str | None:
    """Path of a system OpenBLAS, or None. JUSTFIT_BLAS overrides the search."""
    override = os.environ.get("JUSTFIT_BLAS", "")
    if override in ("0", "none", "off"):
        return None
    if override:
        return override
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    hits = sorted(glob.glob("/usr/lib/*/libopenblas*.so*"))
    return hits[0] if hits else None


def openmp_build(path: str | None) -> bool:
    """Whether the OpenBLAS at `path` is Debian's OpenMP build, whose GEMMs run on the
    same OpenMP threads as the native kernels (the pthread build has threads of its own)."""
    return path is not None and "openblas-openmp" in path


def core_type(cpuinfo: str | None = None) -> str | None:
    """The OpenBLAS kernels to name for this CPU (OPENBLAS_CORETYPE): "SkylakeX" where
    it has Skylake-X's AVX-512 set, else None (OpenBLAS's own choice, which takes a CPU
    model newer than the library for an SSE3 one: docs/ARCHITECTURE.md, process set-up).
    `cpuinfo`: /proc/cpuinfo's text (read when not given; None off Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "SkylakeX" if _SKYLAKEX_FLAGS <= set(flags) else None


def kernels(path: str) -> str | None:
    """The kernels the OpenBLAS at `path` (loaded) chose, e.g. "SkylakeX"; None if it cannot say."""
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return None


def preload() -> str | None:
    """Load OpenBLAS globally on Linux; returns its path or None. Idempotent."""
    global _loaded
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded
    path = find_openblas()
    if path is None:
        return None
    if "mlx.core" in sys.modules:
        # Too late for MLX to bind to it; don't pretend it helps.
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded = path
    return path


def active_blas() -> str:
    """Which BLAS MLX's CPU backend uses in this process, in words."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    # numpy's wheel maps its own private copy (libscipy_openblas); MLX cannot use it.
    system = [l for l in maps.splitlines() if "/libopenblas" in l]
    if _loaded or system:
        path = _loaded or system[0].split()[-1]
        chosen = kernels(path)
        return f"OpenBLAS ({path})" + (f", {chosen} kernels" if chosen else "")
    return "reference BLAS bundled with mlx[cpu] (slow; install libopenblas0-openmp)"

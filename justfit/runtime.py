"""The one place JustFit changes the process: `setup()`.

Importing any justfit, kvexec, phaseswap, statetrans or cli module changes nothing
outside itself. What a running engine needs from the process happens here, when
called, by the three entry points: the `justfit` command (before it imports
anything that loads `mlx.core`), the HTTP server (its engine thread included) and
`Engine.__init__`. Calling it again changes nothing more.

`setup()` does three things:

* OpenBLAS. The `mlx[cpu]` wheel links a reference BLAS; loading a system OpenBLAS
  with RTLD_GLOBAL *before* `mlx.core` is first imported makes MLX's CPU backend
  bind to it instead (see justfit/blas.py), with its Skylake-X kernels named where
  the CPU has them (OPENBLAS_CORETYPE, unless set). Once `mlx.core` is loaded this is
  too late and skipped: the command line calls `setup()` first thing for this reason,
  and so do tests/conftest.py and the benchmark workers that measure JustFit.
* The execution stream. MLX's default streams belong to the thread that made
  them, and a lazy array (a weight loaded on demand, a state restored from disk) can
  only be evaluated on its stream's thread. The server computes on a worker thread,
  on arrays other threads created, so every thread that calls `setup()` gets one
  shared stream as its default. Requests run one at a time (justfit/engine/scheduler.py),
  so the stream is never used by two threads at once.
* mlx-lm without its hub loader. mlx-lm's package `__init__` imports its loader,
  which imports `transformers` (tens of MiB resident, a large share of a small process)
  for tokenizers JustFit's converted GGUF models do not use. When `mlx_lm` is not
  imported yet, it is registered with its `__init__` deferred: `mlx_lm.models.*` load
  alone, and the first name asked of the package itself (`mlx_lm.load`,
  `from mlx_lm import generate`, `__version__`) runs the `__init__` then, so code
  that uses mlx-lm whole still gets it whole. Once `mlx_lm` is loaded this is skipped.

Besides `setup()`, the process-wide settings a running engine asks for go through here
too, and nowhere else: `hold_memory` (MLX's buffer cache and limits, glibc's mmap
threshold), glibc's one arena (set in `setup`) and `at_exit` (work to finish before the
interpreter exits). The native CPU kernels' switch, JUSTFIT_NATIVE, is read by their own
package (`justfit_native`), which kvexec and phaseswap ask; `native_kernels()` says once
whether they run and why.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType
from dataclasses import dataclass

import justfit.blas as blas

log = logging.getLogger("justfit.runtime")
NATIVE_ENV = "JUSTFIT_NATIVE"  # "0": run without JustFit's native kernels (read by justfit_native)


@dataclass(frozen=True)
class Runtime:
    """What `setup()` did to this process."""

    openblas: str | None  # the OpenBLAS library preloaded, or None (none found, or too late)
    exec_stream: object  # the MLX stream every set-up thread computes on (an mx.Stream)


_lock = threading.Lock()
_runtime: Runtime | None = None  # the process's, once setup() ran: a process-wide fact by nature


def setup() -> Runtime:
    """Preload OpenBLAS (when `mlx.core` is not loaded yet) and make the shared
    execution stream this thread's default MLX stream. Idempotent; thread-safe."""
    global _runtime
    with _lock:
        if _runtime is None:
            # An idle OpenMP worker (the native kernels') spins for GOMP_SPINCOUNT rounds
            # before it sleeps. Beside OpenBLAS's pthread build, a long spin held a core
            # through its prefill GEMMs (at the default 300,000 prefill ran far slower
            # than at 10,000). The OpenMP build's GEMMs run on the same threads, so the
            # worker may spin through a decode step's gaps, where each sleep and wake
            # cost time: at 1,000,000 the slow outlier steps go (prefill unchanged).
            rank = "MLX_RANK" in os.environ
            shared = blas.openmp_build(blas.find_openblas()) and not rank
            os.environ.setdefault("GOMP_SPINCOUNT", "1000000" if shared else "10000")
            if rank:  # ranks of a pipeline may share this machine's cores
                # An idle rank's OpenMP (the native kernel) and OpenBLAS threads would spin
                # while it waits, starving the rank that computes. Read once, when each
                # library loads: so before them.
                os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
                os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
            # glibc gives each thread that allocates its own heap (arena), each keeping its
            # freed pages; one arena for the process kept a SmolLM2 request's peak a few
            # MiB lower at the same speed (docs/BENCHMARKS.md, footprint).
            libc = glibc()
            if libc is not None:
                libc.mallopt(-8, 1)  # M_ARENA_MAX, before the libraries start their threads
            core = blas.core_type()  # None off Linux: no /proc/cpuinfo
            if core is not None:  # read when OpenBLAS loads (numpy's own copy too); a user's choice stands
                os.environ.setdefault("OPENBLAS_CORETYPE", core)
            openblas = blas.preload()  # must precede the first `import mlx.core`
            defer_package_init("mlx_lm")
            import mlx.core as mx

            _runtime = Runtime(openblas, mx.new_thread_unsafe_stream(mx.default_device()))
    import mlx.core as mx

    # Per thread: the default stream is thread-local in MLX.
    if mx.default_stream(mx.default_device()) != _runtime.exec_stream:
        mx.set_default_stream(_runtime.exec_stream)
    return _runtime


def defer_package_init(name: str) -> ModuleType | None:
    """Register package `name` (when not imported yet) with its `__init__` run only when
    a name missing from it is first asked for: its submodules import without it. The
    package, or None where it is already imported or not installed."""
    if name in sys.modules:
        return None
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return None
    package = importlib.util.module_from_spec(spec)

    def complete(attr: str):
        del package.__getattr__  # once: the `__init__` below defines the package's names
        spec.loader.exec_module(package)
        return getattr(package, attr)

    package.__getattr__ = complete
    sys.modules[name] = package
    return package


@functools.cache  # justfit.memory.trim_heap runs per prefill chunk: load the library once
def glibc():
    """The C library when it is glibc (Linux), else None: malloc_trim and mallopt are its own."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def current() -> Runtime | None:
    """What `setup()` did, or None when it has not run in this process."""
    return _runtime



def hold_memory(budget: int | None) -> None:
    """Make freed memory go back to the system at once: glibc's mmap threshold (under a
    budget) and, on the CPU, no MLX buffer cache (its buffers are plain process memory
    the planner does not count and a whole-process peak does). On Metal, under a
    budget, MLX's own limits held to it. Process-wide, so only here."""
    import mlx.core as mx

    libc = glibc()
    if budget is not None and libc is not None:
        # By default glibc keeps raising its mmap threshold and recycles freed blocks in
        # its heap, so RSS stays at past transients' high-water mark; 256 KiB and up go
        # back on free instead (a lower peak for slightly slower steps).
        libc.mallopt(-3, 1 << 18)  # M_MMAP_THRESHOLD
    if not (mx.default_device() == mx.gpu and mx.metal.is_available()):
        mx.set_cache_limit(0)
        return
    if budget is not None:
        mx.set_memory_limit(budget)
        mx.set_cache_limit(budget // 8)
        mx.set_wired_limit(min(budget, mx.metal.device_info().get("max_recommended_working_set_size", budget)))


def at_exit(callback) -> None:
    """Run `callback` when the interpreter exits (e.g. wait for queued state writes)."""
    atexit.register(callback)


@functools.cache  # says why once
def native_kernels():
    """JustFit's native CPU kernels (the `justfit_native` extension, built from native/),
    or None: turned off (JUSTFIT_NATIVE=0, read by justfit_native.requested), not built,
    or built for another ABI than this MLX's. Says which once, through logging: without
    them the residency policy and the numerics differ (MLX's kernels run instead)."""
    instead = "MLX's own CPU kernels run instead (slower decode, another residency policy)"
    # ./dev builds native/ on Linux only: elsewhere their absence is expected, not a fault
    level = logging.WARNING if sys.platform.startswith("linux") else logging.INFO
    try:
        import justfit_native
    except ImportError as e:
        log.log(level, "native kernels not built (%s); %s. `./dev setup` builds native/", e, instead)
        return None
    if not justfit_native.requested():
        log.info("native kernels off by request (%s=0): MLX's own kernels run", NATIVE_ENV)
        return None
    try:
        from justfit_native import _ext  # noqa: F401
    except ImportError as e:
        log.log(level, "native kernels not built (%s); %s. `./dev setup` builds native/", e, instead)
        return None
    ext = justfit_native.kernels()
    if ext is None:
        log.log(level, "native kernels (justfit_native) cannot take this MLX's arrays (built against another "
                "MLX or nanobind ABI); %s. Rebuild them: `./dev setup`", instead)
    return ext

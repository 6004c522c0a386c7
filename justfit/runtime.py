"""The one place JustFit changes the process: `setup()`.

Importing any justfit, kvexec, phaseswap, statetrans or cli module changes nothing
outside itself. What a running engine needs from the process happens here, when
called, by the three entry points: the `justfit` command (before it imports
anything that loads `mlx.core`), the HTTP server (its engine thread included) and
`Engine.__init__`. Calling it again changes nothing more.

`setup()` does three things:

* OpenBLAS. The `mlx[cpu]` wheel links a reference BLAS; loading a system OpenBLAS
  with RTLD_GLOBAL *before* `mlx.core` is first imported makes MLX's CPU backend
  bind to it instead (see justfit/blas.py). Once `mlx.core` is loaded this is too
  late and skipped: the command line calls `setup()` first thing for this reason,
  and so do tests/conftest.py and the benchmark workers that measure JustFit.
* The execution stream. MLX's default streams belong to the thread that made
  them, and a lazy array (a weight loaded on demand, a state restored from disk) can
  only be evaluated on its stream's thread. The server computes on a worker thread,
  on arrays other threads created, so every thread that calls `setup()` gets one
  shared stream as its default. Requests run one at a time (justfit/scheduler.py),
  so the stream is never used by two threads at once.
* mlx-lm without its hub loader. mlx-lm's package `__init__` imports its loader,
  which imports `transformers` (tens of MiB resident, a large share of a small process)
  for tokenizers JustFit's converted GGUF models do not use. When `mlx_lm` is not
  imported yet, it is registered with its `__init__` deferred: `mlx_lm.models.*` load
  alone, and the first name asked of the package itself (`mlx_lm.load`,
  `from mlx_lm import generate`, `__version__`) runs the `__init__` then, so code
  that uses mlx-lm whole still gets it whole. Once `mlx_lm` is loaded this is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from types import ModuleType
from dataclasses import dataclass

import justfit.blas as blas


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


def current() -> Runtime | None:
    """What `setup()` did, or None when it has not run in this process."""
    return _runtime


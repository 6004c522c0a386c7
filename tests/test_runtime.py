"""Process-wide effects: importing JustFit changes nothing; `justfit.runtime.setup()`
is the one place that does (OpenBLAS, the shared execution stream); numpy writes into
MLX memory only into a buffer JustFit made; PhaseSwap's hooked classes are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from justfit import runtime
from justfit.blas import active_blas, core_type, find_openblas, openmp_build
from kvexec import attention
from kvexec.formats import get_format

PACKAGES = ("justfit", "kvexec", "phaseswap", "statetrans", "cli")

# What a process looks like to MLX and the OS: printed as JSON, compared across processes.
FACTS = r"""
def facts():
    import os, signal, threading
    import mlx.core as mx
    with open("/proc/self/maps") as f:
        maps = f.read()
    return {"system_openblas": "/libopenblas" in maps,
            "default_stream": repr(mx.default_stream(mx.default_device())),
            "next_stream": repr(mx.new_stream(mx.default_device())),
            "threads": threading.active_count(),
            "sigint": repr(signal.getsignal(signal.SIGINT)), "env": dict(os.environ)}
"""

IMPORT_ALL = FACTS + r"""
import importlib, json, pkgutil, sys
mlx_first = sys.argv[1] == "mlx-first"  # to see the RNG key before (MLX seeds it from the clock)
if mlx_first:
    import mlx.core as mx
    key = mx.random.state[0].tolist()
names = []
for package in sys.argv[2:]:
    module = importlib.import_module(package)
    names.append(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        importlib.import_module(info.name)
        names.append(info.name)
rng_kept = mlx_first and mx.random.state[0].tolist() == key
print(json.dumps({"facts": facts(), "modules": names, "rng_kept": rng_kept}))
"""

# mlx-lm's own import writes TRANSFORMERS_NO_ADVISORY_WARNINGS: its change, not JustFit's.
PRISTINE = FACTS + "import json, mlx_lm\nprint(json.dumps({'facts': facts()}))\n"


def _run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_every_module_changes_nothing_process_wide():
    pristine = _run(PRISTINE)["facts"]
    imported = _run(IMPORT_ALL, "justfit-first", *PACKAGES)
    assert len(imported["modules"]) > 60  # every module of the five packages, server and gguf included
    assert {"justfit.runtime", "justfit.server.app", "kvexec.attention", "phaseswap.phases",
            "statetrans.state", "cli.main", "cli.chat"} <= set(imported["modules"])
    assert imported["facts"] == pristine  # no OpenBLAS, same streams, threads, SIGINT, environment
    assert _run(IMPORT_ALL, "mlx-first", *PACKAGES)["rng_kept"]  # and nothing reseeded MLX's RNG


def test_the_command_line_entry_loads_no_mlx_before_setup_then_gets_openblas():
    code = FACTS + r"""
import json, sys
import cli.main
before = "mlx.core" in sys.modules
try:
    cli.main.main(["--version"])
except SystemExit:
    pass
from justfit import runtime
print(json.dumps({"mlx_before_setup": before, "facts": facts(),
                  "exec_stream": repr(runtime.current().exec_stream)}))
"""
    out = _run(code)
    assert out["mlx_before_setup"] is False
    assert out["facts"]["default_stream"] == out["exec_stream"]
    assert out["facts"]["system_openblas"] == (find_openblas() is not None)


def test_setup_sets_the_openmp_spin_before_anything_loads_it_and_keeps_a_users_choice():
    """Idle OpenMP workers of the native kernels spin 1,000,000 rounds beside OpenBLAS's
    OpenMP build (one pool of threads), 10,000 beside any other: at GNU OpenMP's default
    (300,000) they held a core through the pthread build's prefill GEMMs."""
    code = r"""
import json, os, sys
from justfit import runtime
runtime.setup()
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "gomp_loaded_at_setup": "libgomp" in maps}))
"""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    run = lambda e: json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                              timeout=120, check=True, env=e).stdout.strip().splitlines()[-1])
    out = run(env)
    shared = openmp_build(find_openblas())
    assert out["spin"] == ("1000000" if shared else "10000")
    assert shared or not out["gomp_loaded_at_setup"]  # read when libgomp loads: later (or with the BLAS)
    assert run({**env, "JUSTFIT_BLAS": "none"})["spin"] == "10000"
    assert run({**env, "GOMP_SPINCOUNT": "5"})["spin"] == "5"


def test_setup_names_the_openblas_kernels_the_cpu_has_and_keeps_a_users_choice():
    """OpenBLAS takes a CPU model newer than itself for an SSE3 one (Debian 12's 0.3.21 on
    a recent Xeon: prefill at half speed); where the CPU has Skylake-X's AVX-512 set,
    setup names those kernels before OpenBLAS loads. A user's OPENBLAS_CORETYPE stands."""
    flags = "flags\t\t: fpu sse2 avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl\n"
    assert core_type("processor\t: 0\n" + flags) == "SkylakeX"
    assert core_type(flags.replace(" avx512vl", "")) is None and core_type("processor\t: 0\n") is None
    code = r"""
import json, os
from justfit import runtime
from justfit.blas import active_blas
runtime.setup()
print(json.dumps({"core": os.environ.get("OPENBLAS_CORETYPE"), "blas": active_blas()}))
"""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    run = lambda e: json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                              timeout=120, check=True, env=e).stdout.strip().splitlines()[-1])
    ours, users = run(env), run({**env, "OPENBLAS_CORETYPE": "Haswell"})
    assert ours["core"] == (core_type() if sys.platform.startswith("linux") else None)
    assert users["core"] == "Haswell"
    if find_openblas() is not None and sys.platform.startswith("linux"):  # the kernels it chose, in its words
        assert users["blas"].endswith(", Haswell kernels")
        assert ours["core"] is None or ours["blas"].endswith(f", {ours['core']} kernels")


def test_setup_is_idempotent_and_shares_one_stream_across_threads():
    first = runtime.setup()
    assert runtime.setup() is first is runtime.current()
    assert mx.default_stream(mx.default_device()) == first.exec_stream
    seen = []
    worker = threading.Thread(target=lambda: seen.append((runtime.setup(), mx.default_stream(mx.default_device()))))
    worker.start()
    worker.join()
    assert seen == [(first, first.exec_stream)]
    if find_openblas() is not None:  # tests/conftest.py set up before any test imported mlx
        assert first.openblas and "OpenBLAS" in active_blas()


def _blocks(n_blocks: int, kv_heads: int, length: int, dim: int):
    fmt = get_format("fp32")
    out = []
    for i in range(n_blocks):
        k = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(2 * i))
        v = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(2 * i + 1))
        out.append(attention.Block({"x": k}, {"x": v}, fmt, i * length, length))
    return out


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the numpy softmax step is the CPU backend's")
def test_numpy_softmax_step_writes_only_its_own_scores(monkeypatch):
    monkeypatch.setattr(attention, "rows_kernel", lambda: None)  # the path without the native kernels
    blocks = _blocks(2, kv_heads=2, length=1024, dim=32)
    q = mx.random.normal((1, 4, 256, 32), key=mx.random.key(9))
    mx.eval(q, [b.keys for b in blocks], [b.values for b in blocks])
    inputs = [np.array(a) for a in (q, *(b.keys["x"] for b in blocks), *(b.values["x"] for b in blocks))]
    calls = []
    real_step = attention.softmax_step_numpy
    monkeypatch.setattr(attention, "softmax_step_numpy", lambda s, m: calls.append(s.shape) or real_step(s, m))
    with_numpy = attention.blockwise_attention(q, blocks, 2048 - 256, 32 ** -0.5)
    mx.eval(with_numpy)
    assert calls and calls[0][-1] == 2048  # the two blocks merged, 1M scores: the numpy step ran
    after = [np.array(a) for a in (q, *(b.keys["x"] for b in blocks), *(b.values["x"] for b in blocks))]
    assert all(np.array_equal(a, b) for a, b in zip(inputs, after))  # queries, keys, values untouched
    monkeypatch.setattr(attention, "EVAL_EVERY_BLOCK", 1 << 40)  # the all-MLX step instead
    with_mlx = attention.blockwise_attention(q, blocks, 2048 - 256, 32 ** -0.5)
    assert len(calls) == 1
    np.testing.assert_allclose(np.array(with_numpy), np.array(with_mlx), rtol=1e-5, atol=1e-6)


def test_phaseswap_hooks_with_its_own_classes(tiny_llama_dir):
    from mlx_lm.utils import load

    from phaseswap import PhaseSwap

    model, _ = load(str(tiny_llama_dir), lazy=True)
    layer = model.model.layers[0]
    model_class = type(layer)
    first = PhaseSwap(model, "dense")
    hooked_once = type(layer)
    assert hooked_once.__mro__[1] is model_class and hooked_once.__name__ == model_class.__name__
    second = PhaseSwap(model, "dense")  # hooking again starts from the model's class, not the first's
    assert type(layer) is not hooked_once and type(layer).__mro__[1] is model_class
    assert layer.__dict__["_phaseswap"][0] is second and first is not second
    tokens = mx.array([[1, 2, 3, 4]])
    mx.eval(model(tokens))  # runs through the second swap's hooks


def test_setup_defers_mlx_lms_init_until_the_package_is_asked_for_a_name():
    code = r"""
import json, sys
from justfit import runtime
runtime.setup()
from justfit.model.models import load
loaded = load("smollm2")  # the converted GGUF: mlx-lm's model code, JustFit's tokenizer
light = "transformers" not in sys.modules and "mlx_lm.tokenizer_utils" not in sys.modules
ids = loaded.tokenizer.encode("hello")
import mlx_lm
from mlx_lm import load as stock_load, stream_generate  # the package's own names, as without setup()
print(json.dumps({"light": light, "ids": ids, "version": mlx_lm.__version__, "load": stock_load.__module__,
                  "stream_generate": callable(stream_generate), "transformers": "transformers" in sys.modules}))
"""
    out = _run(code)
    assert out["light"] and out["ids"]
    assert out["version"] and out["load"] == "mlx_lm.utils" and out["stream_generate"] and out["transformers"]
    already = runtime.defer_package_init("json")  # imported: left as it is
    assert already is None and runtime.defer_package_init("no_such_package_here") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_threads_that_allocate_share_one_heap_after_setup():
    # each glibc arena keeps its own freed pages: one arena, one pool of them
    code = """
import ctypes, threading
from justfit import runtime
runtime.setup()
def churn():
    blocks = [bytearray(2000) for _ in range(5000)]
    del blocks
threads = [threading.Thread(target=churn) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
libc = ctypes.CDLL("libc.so.6")
libc.open_memstream.restype = ctypes.c_void_p
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
libc.malloc_info(0, ctypes.c_void_p(f))
libc.fclose(ctypes.c_void_p(f))
print(buf.value.decode().count("<heap nr="))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 1

"""KVExec measurements: attention transient vs context, bytes per position per
format, and decode speed at a given context against stock mlx-lm's KV cache.

    python -m bench.kv transient --contexts 4096,16384,65536
    python -m bench.kv bytes --context 32768
    python -m bench.kv decode --context 8192 --formats fp16,q8,q4

Transient and bytes use SmolLM2's attention shape (9 query heads, 3 KV heads, d=64)
with synthetic keys and values; decode runs the real SmolLM2 with its cache filled
to the context with synthetic keys and values (decode cost does not depend on them),
so stock mlx-lm needs no hour-long prefill on this CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from justfit import runtime

if __name__ == "__main__":  # run as a script; importers (the CLI, tests) set up themselves
    runtime.setup()  # OpenBLAS first, before mlx.core

import mlx.core as mx  # noqa: E402

from kvexec import FORMATS, KVConfig, PageStore, blockwise_attention, get_format

HEADS, KV_HEADS, D = 9, 3, 64


def _fill(store: PageStore, n: int, step: int = 4096) -> None:
    for start in range(0, n, step):
        L = min(step, n - start)
        k = mx.random.normal((1, KV_HEADS, L, D)).astype(mx.float32)
        store.append(k, k)
        mx.eval(store.arrays())


def transient(contexts: list[int], chunk: int, fmt: str) -> list[dict]:
    rows = []
    for n in contexts:
        for L in (chunk, 1):
            store = PageStore(KVConfig(format=fmt))
            _fill(store, n - L)
            q = mx.random.normal((1, HEADS, L, D))
            k = mx.random.normal((1, KV_HEADS, L, D))
            mx.eval(q, k)
            store.append(k, k)
            mx.eval(store.arrays())
            mx.synchronize()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            out = blockwise_attention(q, store.blocks(), n - L, D**-0.5)
            mx.eval(out)
            peak = mx.get_peak_memory() - base
            rows.append({"context": n, "queries": L, "format": fmt, "transient_mib": peak / 2**20,
                         "kv_mib": store.nbytes / 2**20})
            print(json.dumps(rows[-1]), flush=True)
            del store, out
            mx.clear_cache()
    return rows


def bytes_per_position(context: int) -> list[dict]:
    rows = []
    for name in FORMATS:
        store = PageStore(KVConfig(format=name, hot_window=0, sink_tokens=0))
        _fill(store, context)
        fmt = get_format(name)
        measured = store.nbytes / context
        theory = fmt.bytes_per_token(KV_HEADS, D)
        rows.append({"format": name, "context": context, "bytes_per_position_per_layer": measured,
                     "theoretical": theory, "bits_per_value": 8 * measured / (2 * KV_HEADS * D)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode(context: int, formats: list[str], steps: int, policy: str = "auto") -> list[dict]:
    """Decode speed at `context` per row (stock mlx-lm, JustFit on mlx-lm's KV cache, then
    each format spec), each row in a fresh process: in one process a row's speed
    depended on its place (the first JustFit row ran faster whichever format it was)."""
    from bench.common import run_worker

    rows = []
    for name in ["mlx-lm", "justfit-mlx-lm-kv", *formats]:
        row = run_worker("bench.kv", [name, str(context), str(steps), policy], timeout=3600)
        rows.append(row if "error" not in row else {"system": name, "context": context, **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _decode_row(name: str, context: int, steps: int, policy: str) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    import kvexec
    from bench.quality import requested
    from justfit import Engine
    from justfit.config import EngineConfig
    from justfit.model.models import load

    if name == "mlx-lm":  # stock: quantized weights, fp16 activations, its own KV cache
        model, dtype, kv = load("smollm2").model, mx.float16, None
    else:  # a format spec as bench.quality takes it ("calibrated" and allocated ones calibrate first)
        kv = None if name == "justfit-mlx-lm-kv" else requested(name)
        engine = Engine("smollm2", config=EngineConfig(kv=kv, policy=policy))
        model, dtype, kv = engine.model, mx.float32, engine.config.kv
    cache = kvexec.make_cache(model, kv) if kv is not None else make_prompt_cache(model)
    for c in cache:
        for start in range(0, context, 2048):
            k = mx.random.normal((1, KV_HEADS, min(2048, context - start), D)).astype(dtype)
            c.update_and_fetch(k, k)
        mx.eval(c.state)
    y = mx.array([[42]])
    mx.eval(model(y, cache=cache))
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(y, cache=cache))
    tps = steps / (time.perf_counter() - start)
    return {"system": name if "mlx-lm" in name else f"justfit-{name}", "context": context,
            "decode_tps": tps, "kv_mib": sum(c.nbytes for c in cache) / 2**20}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one decode row (see `decode`)
        name, context, steps, policy = argv[1:5]
        print(json.dumps(_decode_row(name, int(context), int(steps), policy)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("transient")
    t.add_argument("--contexts", default="4096,16384,65536")
    t.add_argument("--chunk", type=int, default=512)
    t.add_argument("--format", default="q4")
    b = sub.add_parser("bytes")
    b.add_argument("--context", type=int, default=32768)
    d = sub.add_parser("decode")
    d.add_argument("--context", type=int, default=8192)
    d.add_argument("--formats", default="fp16,q8,q4")
    d.add_argument("--steps", type=int, default=16)
    d.add_argument("--policy", default="auto", help="PhaseSwap policy of the JustFit rows")
    args = ap.parse_args(argv)
    from bench.common import machine_info, save

    if args.what == "transient":
        rows = transient([int(c) for c in args.contexts.split(",")], args.chunk, args.format)
    elif args.what == "bytes":
        rows = bytes_per_position(args.context)
    else:
        rows = decode(args.context, args.formats.split(","), args.steps, args.policy)
    print("saved", save(f"kv-{args.what}", {"machine": machine_info(), "systems": rows}))


if __name__ == "__main__":
    main()

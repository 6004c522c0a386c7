"""Prefill and decode speed, JustFit next to stock mlx-lm, each system in its own
process on the same prompt tokens.

    python -m bench.speed --model smollm2 --contexts 1024,4096 --decode 64
    python -m bench.speed --model gemma3 --contexts 1024,4096,8192,16384,32768 --repeat 3
    python -m bench.speed --quick                 # 256 tokens, 8 decoded: a minute
    python -m bench.speed --systems justfit-default,justfit-disk,justfit-disk-warm --contexts 100000 --synthetic
    python -m bench.speed --llama-cpp ~/llama.cpp/build/bin   # adds llama.cpp, -q8_0 and -q4_0

Systems: `justfit-default` (what `justfit chat` and `serve` run: PhaseSwap policy auto,
i.e. cpu-int16 where the native kernel is built, calibrated KV pages, OpenBLAS; another
page format with `--kv-format`;
`justfit-deterministic` the same with one numerics per token (`--deterministic`: prefill
on the decode forms through row-invariant kernels, justfit.engine.numerics; what the same
reply on every path costs is the difference);
`justfit-disk` the same with every growing layer's KV pages on disk, read back just in
time and dropped from the OS page cache (cold), `justfit-disk-warm` left in it;
`justfit@POLICY` for another PhaseSwap policy, `justfit-default@2` a layer pipeline over
two local ranks, justfit.pipeline.launch); stock `generate_step` on the same
quantized matrices with float16 parameters, as mlx-lm's users run it with the wheel's
own BLAS (bench/stock.py): `mlx-lm` (defaults), `mlx-lm-tuned` (prefill step 512, 8-bit
KV), `mlx-lm-kv4`; `mlx-lm-dense` (not a baseline: JustFit's prefill weight form, dense
float32 with OpenBLAS, in mlx-lm's model code, so the prefill gain splits into weight
form vs the rest); llama.cpp (llama-bench defaults: float16 KV, flash attention auto) and
llama.cpp-q8_0/-q4_0 (flash attention, -ctk/-ctv); its decode is measured after `context`
tokens (llama-bench -d), as JustFit's is.
On MLX's CPU backend float16 quantized matmuls are tens of times slower than float32
ones: the float16 rows take long, and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

SYSTEMS = ("justfit-default", "mlx-lm", "mlx-lm-tuned", "mlx-lm-dense")
QUICK = {"contexts": "256", "decode": 8, "systems": "justfit-default,mlx-lm"}


def _worker(system: str, model: str, context: int, decode: int, kv_format: str = "calibrated",
            synthetic: bool = False) -> dict:
    if system.startswith("justfit") or system == "mlx-lm-dense":
        from justfit import runtime

        runtime.setup()  # preloads OpenBLAS
    import mlx.core as mx

    from justfit.blas import active_blas

    if system.startswith("justfit"):  # "justfit-default", "justfit@POLICY" or "justfit-default@RANKS"
        from justfit import Engine, SamplingParams
        from justfit.config import EngineConfig
        from kvexec import KVConfig

        policy, ranks = _policy_ranks(system)
        group = mx.distributed.init() if ranks > 1 else None
        config = EngineConfig(policy=policy, kv=KVConfig(format=kv_format), context_limit=context + decode + 1)
        if system == "justfit-deterministic":  # the same reply on every path: a prefill row is a decode step
            config = replace(config, deterministic=True)
        if system.startswith("justfit-disk"):  # every growing layer's pages on disk, read back just in time
            import tempfile

            config = replace(config, kv_disk=tempfile.mkdtemp(prefix="justfit-bench-kv-"), kv_disk_layers=1 << 10,
                             kv_disk_cached=system.endswith("-warm"))
        engine = Engine(model, config=config, group=group)
        if group is not None and group.rank() > 0:
            engine.runner.follow(engine)  # until rank 0 is done; only rank 0 prints
            os._exit(0)
        tokens = _prompt(engine.tokenizer, context)
        sp = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
        if synthetic:  # decode only: `context` positions of random keys and values stored first
            from bench.synthetic_state import store_random_state

            store_random_state(engine, tokens[:-1])
            # one step spills and reads the pages once (warm: into the page cache)
            list(engine.generate(tokens, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)))
        start = time.perf_counter()
        first = st = None
        for chunk in engine.generate(tokens, sp):
            if first is None:
                first = time.perf_counter() - start
            st = chunk.stats or st  # the last chunk carries the request's stats
        engine.runner.close()  # a pipeline's other ranks leave (nothing for one process)
        from bench.floor import justfit_read_bytes

        return {"prefill_tps": None if synthetic else st.prefill_tps, "decode_tps": st.decode_tps,
                "ttft_s": None if synthetic else first, "kv_disk": st.kv_disk, "synthetic": synthetic,
                # a pipeline's decode reads on every rank: no one process's floor
                "read_bytes": justfit_read_bytes(engine, context + decode) if group is None else None,
                "peak_mib": st.memory.mlx_peak / 2**20, "rss_peak_mib": st.memory.rss_peak / 2**20,
                "blas": active_blas(), "weights_dtype": f"{engine.policy.name}: {engine.swap.registry.resident_form}",
                "kv_dtype": f"{_pages(engine.config.kv)} pages" if engine.config.kv else "mlx-lm cache",
                "prefill_step": st.prefill_chunk}

    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from bench.stock import STOCK, kv_dtype, load_stock, weights_dtype

    setup = STOCK[system]
    if setup.cache_limit is not None:
        mx.set_cache_limit(setup.cache_limit)
    loaded = load_stock(model, setup)  # the same quantized matrices, mlx-lm's own model code
    tokens = _prompt(loaded.tokenizer, context)
    cache = make_prompt_cache(loaded.model)
    note = ""
    if setup.kv_bits:
        from bench.stock import quantize_what_mlx_lm_can

        note = quantize_what_mlx_lm_can(cache, setup.kv_bits)
    kw = {"kv_bits": setup.kv_bits, "kv_group_size": setup.kv_group_size, "quantized_kv_start": 0} \
        if setup.kv_bits else {}
    mx.reset_peak_memory()
    start = time.perf_counter()
    steps = generate_step(mx.array(tokens), loaded.model, max_tokens=decode, sampler=make_sampler(0.0),
                          prompt_cache=cache, prefill_step_size=setup.prefill_step, **kw)
    next(steps)
    ttft = time.perf_counter() - start
    for _ in range(decode - 1):
        next(steps)
    decode_s = time.perf_counter() - start - ttft
    from bench.floor import stock_read_bytes
    from justfit.memory import peak_rss_bytes

    return {"prefill_tps": context / ttft, "decode_tps": (decode - 1) / decode_s, "ttft_s": ttft,
            "read_bytes": stock_read_bytes(loaded.model, cache),
            "peak_mib": mx.get_peak_memory() / 2**20, "rss_peak_mib": peak_rss_bytes() / 2**20,
            "blas": active_blas(), "weights_dtype": weights_dtype(loaded.model), "kv_dtype": kv_dtype(cache),
            "kv_bits": setup.kv_bits, "prefill_step": setup.prefill_step, **({"note": note} if note else {})}


def _pages(kv) -> str:
    """The page format, or a calibrated configuration's per-layer summary."""
    from kvexec.calibrate import layer_summary

    return layer_summary(kv.layer_formats) if kv.layer_formats else kv.format


def _policy_ranks(system: str) -> tuple[str, int]:
    """"justfit@cpu" -> ("cpu", 1); "justfit-default@2" -> ("auto", 2): a layer
    pipeline over two ranks (justfit.pipeline.layers)."""
    tail = system.partition("@")[2]
    return ("auto", int(tail)) if tail.isdigit() else (tail or "auto", 1)


def _prompt(tokenizer, n):
    from bench.common import prompt_tokens

    return prompt_tokens(tokenizer, n)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR",
                    help="folder with llama.cpp's llama-bench (or the binary), run on the same GGUF")
    ap.add_argument("--kv-format", default="calibrated",
                    help="page format of the JustFit rows (default: the CLI's, calibrated per model)")
    ap.add_argument("--synthetic", action="store_true",
                    help="decode only, after CONTEXT positions of random keys and values of the model's shape "
                         "(no prefill: long contexts in minutes; decode costs what it costs on real ones)")
    ap.add_argument("--worker", nargs=6, metavar=("SYSTEM", "MODEL", "CONTEXT", "DECODE", "KV", "SYNTHETIC"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from bench.common import apply_quick

    apply_quick(args, QUICK, argv)
    if args.worker:
        system, model, context, decode, kv_format, synthetic = args.worker
        print(json.dumps(_worker(system, model, int(context), int(decode), kv_format, synthetic == "1")))
        return {}

    from bench.common import machine_info, progress_bar, run_worker
    from bench.report import publish
    from bench.floor import disk_read_bandwidth, floor_fields, read_bandwidth

    bandwidth = [read_bandwidth()]  # again at the end: the machine is shared
    rows = []
    contexts, systems = [int(c) for c in args.contexts.split(",")], args.systems.split(",")
    bar = progress_bar(len(contexts) * len(systems) * args.repeat, "speed")
    for context in contexts:
        for system in systems:
            runs = []
            for _ in range(args.repeat):
                bar.set_postfix_str(f"{system} @ {context:,}")
                ranks = _policy_ranks(system)[1] if system.startswith("justfit") else 1
                worker = [system, args.model, str(context), str(args.decode), args.kv_format,
                          "1" if args.synthetic else "0"]
                runs.append(run_worker("bench.speed", worker, args.timeout, ranks))
                bar.update()
            ok = [r for r in runs if "error" not in r]
            row = {"system": system, "model": args.model, "context": context, "decode_tokens": args.decode,
                   "runs": len(ok)}
            if ok:
                for key in ("prefill_tps", "decode_tps", "ttft_s", "peak_mib", "rss_peak_mib"):
                    if ok[0][key] is None:
                        continue
                    vals = sorted(r[key] for r in ok)
                    row[key] = vals[len(vals) // 2]  # median; the best run beside it
                    row[f"{key}_best"] = vals[0] if key in ("ttft_s", "peak_mib", "rss_peak_mib") else vals[-1]
                row["read_bytes"] = ok[0].get("read_bytes")
                for key in ("blas", "weights_dtype", "kv_dtype", "kv_bits", "prefill_step", "note", "kv_disk",
                            "synthetic"):
                    if key in ok[0]:
                        row[key] = ok[0][key]  # of the worker process, not this one
            else:
                row["error"] = runs[-1]["error"]
            rows.append(row)
            if not args.json:
                bar.write(json.dumps(row), file=sys.stderr)
    bar.close()
    if args.llama_cpp:
        from bench.llamacpp import llama_bench

        rows += llama_bench(args.llama_cpp, args.model, contexts, args.decode, args.repeat)
    bandwidth.append(read_bandwidth())
    disk = disk_read_bandwidth() if any(s.startswith("justfit-disk") for s in systems) else None
    for row in rows:
        if row.get("read_bytes") and row.get("decode_tps"):
            row.update(floor_fields(row["decode_tps"], row["read_bytes"], max(bandwidth)))
        on_disk = (row.get("kv_disk") or {}).get("bytes_on_disk")
        if disk and on_disk and row.get("decode_tps"):  # every page on disk is read once a token
            row["io_bound_tps"] = round(disk / on_disk, 3)
            row["io_bound_fraction"] = round(row["decode_tps"] / row["io_bound_tps"], 3)
    result = {"machine": machine_info(), "read_bandwidth_gbs": [round(b / 1e9, 3) for b in bandwidth],
              "disk_read_gbs": None if disk is None else round(disk / 1e9, 3), "systems": rows}
    publish("speed", result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""Prefill and decode speed, JustFit next to stock mlx-lm, each system in its own
process on the same prompt tokens.

    python -m bench.speed --model smollm2 --contexts 1024,4096 --decode 64
    python -m bench.speed --model gemma3 --contexts 1024,4096,8192,16384,32768 --repeat 3
    python -m bench.speed --quick                 # 256 tokens, 8 decoded: a minute
    python -m bench.speed --systems justfit-default,justfit-disk,justfit-disk-warm --contexts 100000 --synthetic
    python -m bench.speed --llama-cpp ~/llama.cpp/build/bin   # adds llama.cpp, -q8_0 and -q4_0
    python -m bench.speed --systems justfit-nodraft,justfit-drafts --contexts 512 --depth 16384 --decode 32 \
        --repeat 3 --llama-cpp DIR --llama-systems llama.cpp   # 512 prefilled and 32 decoded after 16,384

`--repeat N` runs N alternating rounds: each round runs every system once (llama.cpp's
too, one llama-bench each) before the next; a row is the median over the rounds with its
range (min-max), and each JustFit-over-llama.cpp ratio the median and range of the
ratios of the same round's runs (`ratios`), never a best of either.

Systems: `justfit-default` (what `justfit chat` and `serve` run: PhaseSwap policy auto,
i.e. cpu-int16 where the native kernel is built, calibrated KV pages, OpenBLAS, n-gram
drafts on: the prompt's own text drafts tokens, verified in one forward, so a decode
that repeats its context takes several tokens a step; another page format with
`--kv-format`); `justfit-nodraft` the same with drafts off (one token a step: the same
work as llama-bench's decode, the row set against it), `justfit-drafts` the same as
`justfit-default`, named for its drafts;
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

from bench.llamacpp import CACHE_TYPES

SYSTEMS = ("justfit-nodraft", "justfit-drafts", "mlx-lm", "mlx-lm-tuned", "mlx-lm-dense")
QUICK = {"contexts": "256", "decode": 8, "systems": "justfit-nodraft,mlx-lm"}


def _worker(system: str, model: str, context: int, decode: int, kv_format: str = "calibrated",
            synthetic: bool = False, depth: int = 0) -> dict:
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
        config = EngineConfig(policy=policy, kv=KVConfig(format=kv_format), context_limit=depth + context + decode + 1,
                              draft="none" if system.startswith("justfit-nodraft") else "ngram")
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
        tokens = _prompt(engine.tokenizer, depth + context)
        sp = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
        prefill = None
        if depth:  # `depth` positions of random keys and values held, then `context` prompt tokens prefilled
            from bench.synthetic_state import store_random_state

            store_random_state(engine, tokens[:depth])
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            # a warm step (first forwards, pages read once) on a token the prompt does not continue with,
            # so the timed prompt below resumes exactly `depth` positions
            other = next(t for t in tokens if t != tokens[depth])
            list(engine.generate([*tokens[:depth], other], one))
            *_, last = engine.generate(tokens, one)
            prefill = last.stats
            tokens = tokens[:depth + 1]  # decode after `depth` positions, as llama-bench's at that depth
        elif synthetic:  # decode only: `context` positions of random keys and values stored first
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

        if prefill is not None:  # the prompt after `depth` positions: its own request
            st_prefill, ttft = prefill.prefill_tps, prefill.prefill_s
        else:
            st_prefill, ttft = (None, None) if synthetic else (st.prefill_tps, first)
        return {"prefill_tps": st_prefill, "decode_tps": st.decode_tps, "ttft_s": ttft, "kv_disk": st.kv_disk,
                "synthetic": synthetic, "depth": depth, "drafts": engine.config.draft,
                "drafted_tokens": st.drafted_tokens, "accepted_tokens": st.accepted_tokens,
                "prefill_tokens": (prefill.prompt_tokens - prefill.cached_tokens) if prefill else None,
                # a pipeline's decode reads on every rank: no one process's floor
                "read_bytes": justfit_read_bytes(engine, depth + context + decode) if group is None else None,
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



def _one(system: str, context: int, args) -> dict:
    """One measurement of `system` at `context`: a fresh worker process (JustFit, mlx-lm)
    or one llama-bench run."""
    if system in CACHE_TYPES:
        from bench.llamacpp import llama_run

        return llama_run(args.llama_cpp, system, args.model, context, args.decode, 1, args.depth,
                         prefill=not args.synthetic)
    from bench.common import run_worker

    ranks = _policy_ranks(system)[1] if system.startswith("justfit") else 1
    worker = [system, args.model, str(context), str(args.decode), args.kv_format, "1" if args.synthetic else "0",
              str(args.depth)]
    return run_worker("bench.speed", worker, args.timeout, ranks)


RATES = ("prefill_tps", "decode_tps", "ttft_s", "peak_mib", "rss_peak_mib")
# what a row takes from its first good run: how it ran, not how fast
HOW = ("blas", "weights_dtype", "kv_dtype", "kv_bits", "prefill_step", "note", "kv_disk", "synthetic", "depth",
       "drafts", "flash_attention", "decode_depth", "prefill_depth", "prefill_tokens")


def spread(values: list[float]) -> dict:
    """The median of `values` and their range: how a figure of several rounds is reported."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _row(system: str, context: int, runs: list[dict], args) -> dict:
    """A system's row at `context`: each rate's median over the rounds, with its min and
    max; every round's figures kept (`rounds`); the last error if no round ran."""
    ok = [r for r in runs if "error" not in r]
    row = {"system": system, "model": args.model, "context": context, "decode_tokens": args.decode, "runs": len(ok)}
    if not ok:
        return {**row, "error": runs[-1]["error"] if runs else "not run"}
    for key in RATES:
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            got = spread(vals)
            row[key], row[f"{key}_min"], row[f"{key}_max"] = got["median"], got["min"], got["max"]
    row["read_bytes"] = ok[0].get("read_bytes")
    row.update({key: ok[0][key] for key in HOW if key in ok[0]})  # of the worker process, not this one
    if any(r.get("drafted_tokens") for r in ok):
        row["drafted_tokens"] = [r.get("drafted_tokens") for r in ok]
        row["accepted_tokens"] = [r.get("accepted_tokens") for r in ok]
    row["rounds"] = [{k: r.get(k) for k in ("prefill_tps", "decode_tps", "error") if r.get(k) is not None}
                     for r in runs]
    return row


def ratios(runs: dict, contexts: list[int], systems: list[str], llama: list[str]) -> list[dict]:
    """Each JustFit system over each llama.cpp system, per context and rate: the ratio of
    the two runs of the same round, its median and range over the rounds both ran
    (never the best of either)."""
    out = []
    for context in contexts:
        for ours in (s for s in systems if s.startswith("justfit")):
            for theirs in llama:
                for key in ("prefill_tps", "decode_tps"):
                    pairs = [(a[key], b[key]) for a, b in zip(runs[ours, context], runs[theirs, context])
                             if a.get(key) and b.get(key)]
                    if pairs:
                        out.append({"system": ours, "over": theirs, "context": context, "rate": key,
                                    **spread([x / y for x, y in pairs]), "each": [round(x / y, 4) for x, y in pairs]})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--repeat", "--rounds", dest="repeat", type=int, default=1,
                    help="alternating rounds: each round runs every system (llama.cpp's too) once per context "
                         "before the next round; rows give the median and the spread (min-max)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR",
                    help="folder with llama.cpp's llama-bench (or the binary), run on the same GGUF")
    ap.add_argument("--llama-systems", default=",".join(CACHE_TYPES),
                    help="which llama.cpp rows with --llama-cpp (llama.cpp: its f16-KV default)")
    ap.add_argument("--kv-format", default="calibrated",
                    help="page format of the JustFit rows (default: the CLI's, calibrated per model)")
    ap.add_argument("--synthetic", action="store_true",
                    help="decode only, after CONTEXT positions of random keys and values of the model's shape "
                         "(no prefill: long contexts in minutes; decode costs what it costs on real ones)")
    ap.add_argument("--depth", type=int, default=0,
                    help="positions held before the prompt: CONTEXT prompt tokens prefilled and DECODE tokens "
                         "decoded after DEPTH (JustFit: random keys and values stored, as --synthetic; "
                         "llama-bench: -d, filled for real, untimed)")
    ap.add_argument("--worker", nargs=7, metavar=("SYSTEM", "MODEL", "CONTEXT", "DECODE", "KV", "SYNTHETIC", "DEPTH"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from bench.common import apply_quick

    apply_quick(args, QUICK, argv)
    if args.worker:
        system, model, context, decode, kv_format, synthetic, depth = args.worker
        print(json.dumps(_worker(system, model, int(context), int(decode), kv_format, synthetic == "1", int(depth))))
        return {}

    from bench.common import machine_info, progress_bar
    from bench.report import publish
    from bench.floor import disk_read_bandwidth, floor_fields, read_bandwidth

    contexts, systems = [int(c) for c in args.contexts.split(",")], args.systems.split(",")
    llama = [s for s in args.llama_systems.split(",") if s] if args.llama_cpp else []
    if set(llama) - set(CACHE_TYPES):
        ap.error(f"unknown llama.cpp systems {sorted(set(llama) - set(CACHE_TYPES))}: "
                 f"choose from {', '.join(CACHE_TYPES)}")
    if args.depth and any(not s.startswith("justfit") for s in systems):
        ap.error("--depth holds random keys and values: JustFit systems only (and llama.cpp's)")
    bandwidth = [read_bandwidth()]  # again at the end: the machine is shared
    everyone = systems + llama
    runs: dict[tuple[str, int], list[dict]] = {(s, c): [] for c in contexts for s in everyone}
    bar = progress_bar(len(contexts) * len(everyone) * args.repeat, "speed")
    for rnd in range(args.repeat):  # alternating: every system once per round, the order turned each round
        for context in contexts:
            for system in everyone[rnd % len(everyone):] + everyone[:rnd % len(everyone)]:
                bar.set_postfix_str(f"round {rnd + 1}: {system} @ {context:,}")
                runs[system, context].append(_one(system, context, args))
                bar.update()
    bar.close()
    rows = [_row(system, context, runs[system, context], args) for context in contexts for system in everyone]
    for row in rows if not args.json else []:
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), file=sys.stderr)
    bandwidth.append(read_bandwidth())
    disk = disk_read_bandwidth() if any(s.startswith("justfit-disk") for s in systems) else None
    for row in rows:
        if row.get("read_bytes") and row.get("decode_tps"):
            row.update(floor_fields(row["decode_tps"], row["read_bytes"], max(bandwidth)))
        on_disk = (row.get("kv_disk") or {}).get("bytes_on_disk")
        if disk and on_disk and row.get("decode_tps"):  # every page on disk is read once a token
            row["io_bound_tps"] = round(disk / on_disk, 3)
            row["io_bound_fraction"] = round(row["decode_tps"] / row["io_bound_tps"], 3)
    settings = {"model": args.model, "contexts": contexts, "decode": args.decode, "rounds": args.repeat,
                "depth": args.depth, "synthetic": args.synthetic, "systems": everyone, "kv_format": args.kv_format}
    result = {"machine": machine_info(), "settings": settings,
              "read_bandwidth_gbs": [round(b / 1e9, 3) for b in bandwidth],
              "disk_read_gbs": None if disk is None else round(disk / 1e9, 3), "systems": rows,
              "ratios": ratios(runs, contexts, systems, llama)}
    publish("speed", result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""Fidelity of each KV format against uncompressed attention, teacher-forced on a
long text: top-1 agreement of next-token predictions, mean KL(reference || format),
and perplexity, all from one lockstep pass (reference and every format on the same
chunks), so no logits are stored.

    python -m bench.quality --model smollm2 --tokens 8192 --formats fp16,q8,q4,q3,q2
    python -m bench.quality --skip-teacher-forced --passkey-lengths 1024,2048,4096
    python -m bench.quality --formats q8c,q8c@0.6,q8c@0.45   # pages held to 60%, 45% of q8c's bytes
    python -m bench.quality --formats calibrated,calibrated/0.05,k5a128v4r64   # calibrated per model

With `--context N` every row scores llama-perplexity's windows (bench.scoring: chunks
of N tokens, each in a fresh cache, its second half scored), and the baselines' KV
caches can be measured on the same tokens, each against its own engine's float16 KV
(bench.peer_fidelity):

    python -m bench.quality --model smollm2 --context 2048 --tokens 8192 --formats calibrated \
        --reference fp16 --llama-cpp ~/llama.cpp/build/bin --mlx-lm-kv 8

Pass-key retrieval: noise lines, one pass-key line at each depth, then the question;
a hit is a greedy reply whose first integer is the key.

The reference is mlx-lm's own KV cache in fp32 (the engine's compute dtype on CPU), or
with `--reference fp16` float16 pages (what capacity rows' fidelity is measured against).
"""

from __future__ import annotations

import argparse
import json
import sys

from justfit import runtime

if __name__ == "__main__":  # run as a script; importers (the CLI, tests) set up themselves
    runtime.setup()  # OpenBLAS first, before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import kvexec
from justfit import Engine
from justfit.config import EngineConfig
from justfit.model.loader import kv_calibration
from justfit.engine.state_io import model_identity, state_root
from kvexec import KVConfig
from kvexec.calibrate import calibrated_config, layer_summary
from phaseswap.policy import get_policy

# Formats are compared with float32 activations (the native kernel where built): rounded
# ones (cpu-int16, cpu-int8) could turn a format's last-bit differences into rounding
# flips and measure the rounding as much as the pages. `--policy auto` measures them with
# the activations the engine runs with here (both the pages and their reference).
POLICY = "cpu-native"


def evaluate(model_name: str, n_tokens: int, formats: list[str], chunk: int = 512,
             reference: str = "fp32", context: int | None = None, policy: str = POLICY) -> list[dict]:
    """Teacher-forced top-1, KL and perplexity of each format against `reference`:
    "fp32", mlx-lm's own cache in the engine's compute dtype, or "fp16", pages in
    float16 (the float16-KV reference a stock float16 run keeps). `context`: score
    llama-perplexity's windows of that length (bench.scoring) instead of one sequence."""
    from bench.scoring import score

    engine = Engine(model_name, config=EngineConfig(kv=KVConfig(), policy=policy))
    model = engine.model
    layout, ids = text_layout(engine.tokenizer, n_tokens, context)
    length = context or n_tokens
    configs = {f: kv_config(engine, model_name, f) for f in formats}

    def paged(spec: str, kv: KVConfig):
        return lambda: _paged_cache(model, spec, kv, length, engine.kv_shape)

    def forward(piece: list[int], cache) -> np.ndarray:
        logits = model(mx.array(piece)[None], cache=cache)[0].astype(mx.float32)
        mx.eval(logits, [c.state for c in cache])
        # Statistics in numpy: its vectorized exp is ~20x MLX CPU's on vocab-wide rows.
        return np.array(logits)

    made = {}  # each format's last cache: where the pressure ladder left its pages

    def keep(f: str):
        def make():
            made[f] = paged(f, configs[f])()
            return made[f]
        return make

    ref = (lambda: make_prompt_cache(model)) if reference == "fp32" else paged(reference, KVConfig(format=reference))
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        print(f"{done[0]}/{layout.chunks * (length - 1)} tokens", file=sys.stderr, flush=True)

    tallies = score(layout, ids, (ref, forward), {f: (keep(f), forward) for f in formats}, chunk, progress)
    out = []
    for f in ["reference", *formats]:
        out.append({"system": f"justfit-{f}" if f != "reference" else f"reference-{reference}", "model": model_name,
                    "format": f, **layout.describe(), **tallies[f].row(tallies["reference"]),
                    "reference": "mlx-lm KV in float32" if reference == "fp32" else f"JustFit {reference} pages",
                    "policy": get_policy(policy).name,
                    "bits_per_value": _bits_per_value(KVConfig(format=reference) if f == "reference" else configs[f],
                                                      engine.kv_shape)})
        if f != "reference" and configs[f].layer_formats:
            out[-1]["layer_formats"] = layer_summary(configs[f].layer_formats)
            growing = [i for i, c in enumerate(c for c in made[f] if isinstance(c, kvexec.PagedKVCache))
                       if c.store.window is None]
            out[-1]["bits_per_value_growing"] = _bits_per_value(configs[f], engine.kv_shape, growing)
        if "@" in f:  # where the ladder left the pages (the last window's): positions per format, all layers
            out[-1]["kv_formats"] = kvexec.page_formats(made[f])
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def text_layout(tokenizer, n_tokens: int, context: int | None):
    """(bench.scoring.Layout, the token ids of bench.common.long_text) for `tokenizer`."""
    from bench.common import long_text
    from bench.scoring import Layout, adds_bos

    return Layout(n_tokens, context, adds_bos(tokenizer)), list(tokenizer.encode(long_text()))


def peers(args) -> list[dict]:
    """The baselines' rows (bench.peer_fidelity) on the windows JustFit's were scored on."""
    from bench.common import long_text
    from bench.peer_fidelity import llamacpp_rows, mlx_lm_rows
    from justfit.model.models import load

    layout, ids = text_layout(load(args.model).tokenizer, args.tokens, args.context)
    rows = []
    if args.llama_cpp:
        rows += llamacpp_rows(args.llama_cpp, args.model, long_text(), layout, ids,
                              tuple(args.llama_cache_types.split(",")))
    if args.mlx_lm_kv:
        for dtype in args.mlx_lm_dtype.split(","):
            rows += mlx_lm_rows(args.model, layout, ids, args.mlx_lm_kv, dtype=dtype,
                                limit_s=args.mlx_lm_limit * 60, chunk=args.chunk)
    return rows


def _bits_per_value(kv: KVConfig, kv_shape: tuple[int, int, int], layers=None) -> float | None:
    """Page storage bits per K or V value, every scale, bias and norm included, over the
    layers (`layers`: those attention layers; for `FMT@SHARE`, FMT's before any page steps
    down; the reference's: fp32 or fp16)."""
    return 8 * kvexec.page_bytes_per_token(kv, kv_shape[1], kv_shape[2], layers) / (2 * kv_shape[1] * kv_shape[2])


def requested(spec: str) -> KVConfig:
    """The KVConfig a format spec asks for, before any calibration (see `kv_config`)."""
    name, _, tolerance = spec.partition("@")[0].partition("/")
    return KVConfig(format=name, calibration_tolerance=float(tolerance) if tolerance else None)


def kv_config(engine, model_name: str, spec: str) -> KVConfig:
    """The pages `spec` names: FMT, `FMT@SHARE`, "calibrated" or "calibrated/TOLERANCE"
    (per-layer formats from kvexec.calibrate), or an allocated format `k<mean>a<group>v...`
    (its per-channel key widths calibrated for this model)."""
    kv = requested(spec)
    calibration = kv_calibration(model_name, EngineConfig(kv=kv), lambda: model_identity(engine, state_root()))
    return kv if calibration is None else calibrated_config(kv, calibration)


def _paged_cache(model, spec: str, kv: KVConfig, n_tokens: int, kv_shape: tuple[int, int, int]) -> list:
    """Pages as `kv` keeps them, or for `FMT@SHARE` held to SHARE of the bytes they would
    take for `n_tokens`: past that they step down KVConfig.pressure, oldest first, as
    under a tight budget (the early chunks are scored before any page steps)."""
    cache = kvexec.make_cache(model, kv)
    share = spec.partition("@")[2]
    if share:
        per_layer = float(share) * n_tokens * kvexec.page_bytes_per_token(kv, kv_shape[1], kv_shape[2])
        kvexec.limit_pages(cache, int(per_layer))
    return cache


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """~`length` tokens of noise lines with one pass-key line at `depth` (0..1)."""
    noise = list(tokenizer.encode(NOISE, add_special_tokens=False))
    line = list(tokenizer.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n",
                                 add_special_tokens=False))
    question = list(tokenizer.encode("What is the pass key? The pass key is", add_special_tokens=False))
    n = max(1, (length - len(line) - len(question)) // len(noise))
    before = int(round(n * depth))
    return noise * before + line + noise * (n - before) + question


def passkey(model_name: str, lengths: list[int], depths: list[float], formats: list[str]) -> list[dict]:
    """Pass-key retrieval per format: hit = the first integer of the greedy reply is the key."""
    import random
    import re

    from justfit import SamplingParams

    rng = random.Random(0)
    trials = [(n, d, rng.randrange(10000, 99999)) for n in lengths for d in depths]
    rows = []
    for f in ["reference", *formats]:
        if "@" in f:
            rows.append({"system": f"justfit-{f}", "model": model_name, "format": f,
                         "error": "pressure specs (FMT@SHARE) are measured teacher-forced only"})
            continue
        kv = None if f == "reference" else requested(f)
        engine = Engine(model_name, config=EngineConfig(kv=kv, policy=POLICY))
        hits = {n: 0 for n in lengths}
        for n, depth, key in trials:
            engine.reset()
            reply = engine.complete(passkey_prompt(engine.tokenizer, n, depth, key),
                                    SamplingParams(temperature=0, max_tokens=8))
            found = re.search(r"\d+", reply)
            hits[n] += bool(found and int(found.group()) == key)
        for n in lengths:
            rows.append({"system": f"justfit-{f}" if kv else "reference-fp32", "model": model_name, "format": f,
                         "context": n, "passkey_hits": hits[n], "passkey_trials": len(depths)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


QUICK = {"tokens": 512, "formats": "q8c", "passkey_lengths": "384", "depths": "0.5"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the text (with --context: its multiple)")
    ap.add_argument("--context", type=int, default=None,
                    help="score llama-perplexity's windows of this many tokens (each in a fresh cache, its "
                         "second half scored) instead of one sequence of --tokens; needed for the baselines")
    ap.add_argument("--formats", default="fp16,q8,q4,q3,q2", help="JustFit's page formats; empty: none")
    ap.add_argument("--chunk", type=int, default=512, help="tokens fed a forward pass")
    ap.add_argument("--reference", default="fp32", choices=("fp32", "fp16"),
                    help="fp32: mlx-lm's cache in the compute dtype; fp16: float16 pages")
    ap.add_argument("--policy", default=POLICY, help="JustFit's weight policy (auto: what the engine runs with here)")
    ap.add_argument("--llama-cpp", default="", help="llama.cpp's binaries: measure its KV cache types too")
    ap.add_argument("--llama-cache-types", default="f16,q8_0,q4_0")
    ap.add_argument("--mlx-lm-kv", type=int, default=0, help="bits of mlx-lm's QuantizedKVCache to measure; 0: skip")
    ap.add_argument("--mlx-lm-dtype", default="float16",
                    help="mlx-lm's parameters, activations and reference KV: float16 (as its users run it), "
                         "float32, float32-dense (weights dequantized: BLAS on the CPU), or a list")
    ap.add_argument("--mlx-lm-limit", type=float, default=20, help="minutes: mlx-lm rows past this are not measured")
    ap.add_argument("--passkey-lengths", default="", help="e.g. 1024,2048,4096; empty: skip")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--skip-teacher-forced", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    args = ap.parse_args(argv)
    from bench.common import apply_quick, machine_info
    from bench.report import publish

    apply_quick(args, QUICK, argv)

    formats = [f for f in args.formats.split(",") if f]
    if not {*args.mlx_lm_dtype.split(",")} <= {"float16", "float32", "float32-dense"}:
        ap.error(f"--mlx-lm-dtype takes float16, float32, float32-dense or a list, not {args.mlx_lm_dtype!r}")
    if args.context and args.tokens % args.context:
        ap.error(f"--tokens {args.tokens} is not a multiple of --context {args.context}")
    rows = [] if args.skip_teacher_forced else evaluate(args.model, args.tokens, formats, args.chunk, args.reference,
                                                        args.context, args.policy)
    if not args.skip_teacher_forced and (args.llama_cpp or args.mlx_lm_kv):
        rows += peers(args)
    if args.passkey_lengths:
        lengths = [int(n) for n in args.passkey_lengths.split(",")]
        rows += passkey(args.model, lengths, [float(d) for d in args.depths.split(",")], formats)
    publish("quality", {"machine": machine_info(), "systems": rows}, args.json)


if __name__ == "__main__":
    main()

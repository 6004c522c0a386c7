"""The baselines' KV fidelity, each against its own engine's float16 KV, on the windows
bench.quality scores JustFit's pages on (bench.scoring's layout, llama-perplexity's own):

- llama.cpp: `llama-perplexity` saves its f16-KV logits (`--kl-divergence-base`) on the
  text, then runs each cache type (-ctk/-ctv, flash attention on for every type: a
  quantized V cache needs it) against them with `--kl-divergence`; its "Same top p",
  mean KLD and PPL(Q)/PPL(base) are the rows' top-1, KL and perplexity ratio. The logits
  file holds the tokens it evaluated, which are checked against JustFit's tokenization.
- mlx-lm: its QuantizedKVCache against its own KVCache, both on the model as its users
  load it, teacher-forced in lockstep like JustFit's formats.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_CACHE_TYPES = ("f16", "q8_0", "q4_0")
# Storage bits a value: q8_0 keeps 32 int8 values and a float16 scale in 34 bytes, q4_0 in 18.
_BITS = {"f16": 16.0, "q8_0": 34 * 8 / 32, "q4_0": 18 * 8 / 32, "q5_0": 22 * 8 / 32, "q5_1": 24 * 8 / 32}


def read_logits_header(path: str | Path) -> tuple[int, int, int, list[int]]:
    """(n_ctx, n_vocab, n_chunk, tokens) from the head of a `--kl-divergence-base` file;
    ValueError when it is not one or is cut short."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        head = f.read(12)
        if len(head) != 12:
            raise ValueError(f"{path} is cut short")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head)
        if n_ctx < 1 or n_chunk < 1 or n_vocab < 1:
            raise ValueError(f"{path} has a bad header: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}")
        raw = f.read(4 * n_ctx * n_chunk)
    if len(raw) != 4 * n_ctx * n_chunk:
        raise ValueError(f"{path} is cut short in its tokens")
    return n_ctx, n_vocab, n_chunk, list(struct.unpack(f"<{n_ctx * n_chunk}i", raw))


_NUM = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?)"
_KLD_FIELDS = {
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ppl_base": rf"Mean PPL\(base\)\s*:\s*{_NUM}",
    "ppl_ratio": rf"Mean PPL\(Q\)/PPL\(base\)\s*:\s*{_NUM}\s*±\s*{_NUM}",
    "kl": rf"Mean\s+KLD:\s*{_NUM}\s*±\s*{_NUM}",
    "top1": rf"Same top p:\s*{_NUM}\s*±\s*{_NUM}\s*%",
}


def parse_kl_divergence(log: str) -> dict:
    """The summary of a `llama-perplexity --kl-divergence` run: top1 (a fraction), kl,
    ppl, ppl_base, ppl_delta (PPL(Q)/PPL(base) - 1) and each one's ± where printed;
    ValueError naming what is missing."""
    out = {}
    for key, pattern in _KLD_FIELDS.items():
        m = re.search(pattern, log)
        if m is None:
            raise ValueError(f"no {key} in llama-perplexity's output")
        value, *err = (float(g) for g in m.groups())
        scale = 0.01 if key == "top1" else 1.0  # printed in percent
        out[key] = value * scale
        if err:
            out[f"{key}_err"] = err[0] * scale
    out["ppl_delta"] = out.pop("ppl_ratio") - 1
    out["ppl_delta_err"] = out.pop("ppl_ratio_err")
    return out


def parse_log_facts(log: str) -> dict:
    """What llama.cpp's log says it ran with: flash attention, KV rotation, BOS."""
    facts = {}
    if m := re.search(r"flash_attn\s*=\s*(\w+)", log):
        facts["flash_attention"] = m.group(1)
    rot = [int(v) for v in re.findall(r"attn_rot_[kv] = (\d+)", log)]
    if rot:
        facts["kv_rotation"] = "Hadamard" if any(rot) else "none"
    if m := re.search(r"tokenizer\.ggml\.add_bos_token\s+bool\s+=\s+(\w+)", log):
        facts["adds_bos"] = m.group(1) == "true"
    return facts


def _perplexity_cmd(exe: str, gguf: str, context: int, chunks: int, cache_type: str) -> list[str]:
    # one window a batch (-b = context up to llama.cpp's default 2,048): every chunk alone in its cache
    return [exe, "-m", gguf, "-c", str(context), "--chunks", str(chunks), "-b", str(min(context, 2048)),
            "-fa", "on", "-ctk", cache_type, "-ctv", cache_type, "-t", str(os.cpu_count() or 1), "-lv", "4"]


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    log = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama-perplexity exit {proc.returncode}: {tail}")
    return log


def llamacpp_rows(llama_cpp: str, model: str, text: str, layout, ids: list[int],
                  cache_types: tuple[str, ...] = LLAMA_CACHE_TYPES, timeout: float = 3 * 3600) -> list[dict]:
    """One row per cache type: its fidelity against llama.cpp's own f16 KV on `layout`'s
    windows of `text`, with whether llama.cpp's tokens are JustFit's `ids`; error rows
    when llama-perplexity is missing or fails (a base failure: every row)."""
    from bench.llamacpp import _gguf, binary

    exe = binary(llama_cpp, "llama-perplexity") if llama_cpp else ""
    base_row = {"model": model, **layout.describe(), "reference": "llama.cpp f16 KV (its own logits)"}
    rows = [{"system": f"llama.cpp-{t}", "format": t, **base_row} for t in cache_types]
    if layout.context is None:
        return [{**r, "error": "llama.cpp is measured on windows only: pass --context"} for r in rows]
    if not exe or not Path(exe).is_file():
        return [{**r, "error": f"no llama-perplexity{' at ' + exe if exe else ''}: pass --llama-cpp DIR"} for r in rows]
    gguf = _gguf(model)
    with tempfile.TemporaryDirectory(prefix="justfit-kld-") as tmp:
        text_path, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        text_path.write_text(text, encoding="utf-8")
        try:
            start = time.perf_counter()
            log = _run(_perplexity_cmd(exe, gguf, layout.context, layout.chunks, "f16") +
                       ["-f", str(text_path), "--kl-divergence-base", str(base)], timeout)
            base_s = time.perf_counter() - start
            n_ctx, _, n_chunk, tokens = read_logits_header(base)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
            return [{**r, "error": f"f16 base run failed: {e}"} for r in rows]
        if (n_ctx, n_chunk) != (layout.context, layout.chunks):
            return [{**r, "error": f"llama.cpp ran {n_chunk} chunks of {n_ctx}, not {layout.chunks} of "
                                   f"{layout.context} (the text is too short?)"} for r in rows]
        alignment = token_alignment(tokens, ids[: len(tokens)])
        facts = parse_log_facts(log)
        for r in rows:
            try:
                start = time.perf_counter()
                log = _run(_perplexity_cmd(exe, gguf, layout.context, layout.chunks, r["format"]) +
                           ["--kl-divergence-base", str(base), "--kl-divergence"], timeout)
                r.update(parse_kl_divergence(log), **alignment, **{**facts, **parse_log_facts(log)},
                         bits_per_value=_BITS.get(r["format"]), run_s=round(time.perf_counter() - start, 1),
                         base_run_s=round(base_s, 1))
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                r["error"] = f"--kl-divergence run failed: {e}"
            print(json.dumps(r), file=sys.stderr, flush=True)
    return rows


def token_alignment(theirs: list[int], ours: list[int]) -> dict:
    """Whether llama.cpp evaluated the tokens JustFit scores: counts and the first difference."""
    differ = [i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b]
    out = {"tokens_match": len(theirs) == len(ours) and not differ, "token_mismatches": len(differ)}
    if differ:
        out["first_mismatch"] = differ[0]
    if len(theirs) != len(ours):
        out["token_counts"] = [len(theirs), len(ours)]
    return out


def mlx_lm_rows(model: str, layout, ids: list[int], bits: int = 8, group_size: int = 64, dtype: str = "float16",
                limit_s: float = 1200.0, chunk: int = 512) -> list[dict]:
    """mlx-lm's QuantizedKVCache (`bits`, `group_size`) against its KVCache on the model
    loaded as `bench.stock` loads it, parameters in `dtype` ("float16", "float32", or
    "float32-dense": the quantized matrices dequantized, which MLX's CPU multiplies
    through BLAS, far faster than its quantized float32 products; the same values):
    (reference row, quantized row). Where a probe or the pieces fed so far say the run
    would pass `limit_s`, both rows say so (not measured) instead of blocking."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from dataclasses import replace

    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from bench.scoring import score
    from bench.stock import STOCK, load_stock

    floats, _, dense = dtype.partition("-")
    name = f"mlx-lm-kv{bits}" + ("" if dtype == "float16" else f"-{dtype}")
    rows = [{"system": f"mlx-lm-{dtype}", "format": f"{floats} KV"},
            {"system": name, "format": f"q{bits}g{group_size}"}]
    matrices = "quantized matrices dequantized" if dense else "quantized matrices as stored"
    common = {"model": model, **layout.describe(), "reference": f"mlx-lm KVCache, {floats} activations and KV",
              "weights_dtype": f"{floats} ({matrices})"}
    rows = [{**r, **common} for r in rows]
    loaded = load_stock(model, replace(STOCK["mlx-lm"], dtype=floats, dense=bool(dense)))
    net = loaded.model

    def quantized():
        # Quantized from the first token (a stricter test than generate_step, which
        # quantizes after the first prefill step); sliding-window caches stay as they
        # are: mlx-lm cannot quantize them (RotatingKVCache: NYI).
        return [QuantizedKVCache(group_size, bits) if type(c) is KVCache else c for c in make_prompt_cache(net)]

    total = layout.chunks * ((layout.context or layout.tokens) - 1)  # tokens fed, each by both caches

    class OverLimit(Exception):
        pass

    def check(rate: float, what: str) -> None:
        projected = 2 * total / rate
        if projected > limit_s:
            raise OverLimit(f"not measured: {dtype} forward passes ran {rate:.2f} tok/s on this CPU ({what}); "
                            f"{total} tokens through two caches would take ~{projected / 60:.0f} min "
                            f"(limit {limit_s / 60:.0f} min)")

    def forward(piece, cache):
        logits = net(mx.array(piece)[None], cache=cache)[0].astype(mx.float32)
        mx.eval(logits, [c.state for c in cache])
        return np.array(logits)

    start, fed = time.perf_counter(), [0]

    def progress(n: int) -> None:
        fed[0] += n
        print(f"mlx-lm {fed[0]}/{total} tokens", file=sys.stderr, flush=True)
        check(2 * fed[0] / (time.perf_counter() - start), f"{fed[0]} tokens")

    try:
        # A short probe first: a slow dtype is reported within seconds, not after a whole piece.
        forward(ids[:4], make_prompt_cache(net))  # the first pass's one-time costs stay out of the probe
        probe = ids[: min(chunk, 32)]
        began = time.perf_counter()
        forward(probe, make_prompt_cache(net))
        check(len(probe) / (time.perf_counter() - began), f"a {len(probe)}-token probe")
        tallies = score(layout, ids, (lambda: make_prompt_cache(net), forward), {name: (quantized, forward)},
                        chunk, progress)
    except OverLimit as e:
        return [{**r, "error": str(e)} for r in rows]
    bits_value = {"float16": 16.0, "float32": 32.0}.get(floats)
    rows[0].update(tallies["reference"].row(tallies["reference"]), bits_per_value=bits_value)
    # 8-bit codes plus a scale and a bias (the activations' dtype) per group
    scale_bits = 2 * (bits_value or 16) / group_size
    held = quantized()
    rows[1].update(tallies[name].row(tallies["reference"]), bits_per_value=bits + scale_bits,
                   kv_cache=f"QuantizedKVCache in {sum(isinstance(c, QuantizedKVCache) for c in held)} of "
                            f"{len(held)} layers, from the first token")
    return rows

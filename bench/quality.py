"""Fidelity of each KV format against uncompressed attention, teacher-forced on a
long text: top-1 agreement of next-token predictions, mean KL(reference || format),
and perplexity, all from one lockstep pass (reference and every format on the same
chunks), so no logits are stored.

    python -m bench.quality --model smollm2 --tokens 8192 --formats fp16,q8,q4,q3,q2

The reference is mlx-lm's own KV cache in fp32 (the engine's compute dtype on CPU).
"""

from __future__ import annotations

import argparse
import json
import math

import justfit  # noqa: F401  (OpenBLAS first)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import kvexec
from justfit import Engine
from justfit.config import EngineConfig
from kvexec import KVConfig


def evaluate(model_name: str, n_tokens: int, formats: list[str], chunk: int = 512) -> list[dict]:
    from bench.common import long_text

    engine = Engine(model_name, config=EngineConfig(kv=KVConfig()))
    model, tok = engine.model, engine.tokenizer
    ids = list(tok.encode(long_text()))[:n_tokens]
    if len(ids) < n_tokens:
        raise SystemExit(f"text has only {len(ids)} tokens")
    ref_cache = make_prompt_cache(model)
    caches = {f: kvexec.make_cache(model, KVConfig(format=f)) for f in formats}
    stats = {f: {"agree": 0, "kl": 0.0, "nll": 0.0} for f in ["reference", *formats]}
    scored = 0
    for start in range(0, n_tokens - 1, chunk):
        piece = ids[start : min(start + chunk, n_tokens - 1)]
        targets = mx.array(ids[start + 1 : start + 1 + len(piece)])
        x = mx.array(piece)[None]
        ref = model(x, cache=ref_cache)[0].astype(mx.float32)
        ref_lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
        ref_top = mx.argmax(ref, axis=-1)
        rows = {"reference": ref_lp}
        for f, cache in caches.items():
            out = model(x, cache=cache)[0].astype(mx.float32)
            rows[f] = out - mx.logsumexp(out, axis=-1, keepdims=True)
        for f, lp in rows.items():
            s = stats[f]
            s["agree"] += int((mx.argmax(lp, axis=-1) == ref_top).sum().item())
            s["kl"] += float((mx.exp(ref_lp) * (ref_lp - lp)).sum().item())
            s["nll"] -= float(mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item())
        mx.eval([c.state for c in ref_cache])
        scored += len(piece)
        print(f"{scored}/{n_tokens - 1} tokens", flush=True)
    ref_ppl = math.exp(stats["reference"]["nll"] / scored)
    out = []
    for f in ["reference", *formats]:
        s = stats[f]
        ppl = math.exp(s["nll"] / scored)
        out.append({"system": f"justfit-{f}" if f != "reference" else "reference-fp32", "model": model_name,
                    "format": f, "tokens": n_tokens, "top1": s["agree"] / scored, "kl": s["kl"] / scored,
                    "ppl": ppl, "ppl_delta": ppl / ref_ppl - 1})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--formats", default="fp16,q8,q4,q3,q2")
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    from bench.common import machine_info, save

    rows = evaluate(args.model, args.tokens, args.formats.split(","), args.chunk)
    print("saved", save("quality", {"machine": machine_info(), "systems": rows}))


if __name__ == "__main__":
    main()

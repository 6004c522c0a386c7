"""Faithfulness of the GGUF import against llama.cpp's reference outputs: prompt
tokens, greedy continuations (matching prefix length) and LICENSE perplexity.

    python -m bench.parity [--gemma-bits exact]
    python -m bench.parity --policy cpu     # through the engine, as served (PhaseSwap policy)

Without --policy the imported weights are materialized dense (the import itself is
measured); with it, greedy tokens come from Engine.generate and perplexity runs in the
engine's prefill phase, so the policy's weight forms (cpu: q8t decode) are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "llamacpp-parity.json"
LICENSE = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "LICENSE.txt")
KEYS = {"smollm2": "smollm2-135m-instruct-q4_1", "gemma3": "gemma3-270m-q4_k_m"}


def greedy(model, tokens: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def greedy_matches(loaded, cases: list[dict], n: int = 24) -> list[int]:
    """Per prompt: how many leading greedy tokens equal llama.cpp's continuation."""
    out = []
    for case in cases:
        want = loaded.tokenizer.encode(case["continuation_24"], add_special_tokens=False)
        out.append(matching_prefix(greedy(loaded.model, case["prompt_tokens"], n), want))
    return out


def license_perplexity(loaded, add_bos: bool):
    from justfit.model.perplexity import perplexity

    with open(LICENSE, encoding="utf-8") as f:
        tokens = list(loaded.tokenizer.encode(f.read()))
    return perplexity(loaded.model, tokens, 512, loaded.tokenizer.bos_token_id if add_bos else None)


def load_dense(name: str, bits: int | str = "native"):
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core
    from justfit.model.gguf.cache import RequantOptions
    from justfit.model.models import load
    from phaseswap import materialize_dense

    loaded = load(name, RequantOptions(bits=bits))
    materialize_dense(loaded.model)
    return loaded


def engine_row(name: str, policy: str, r: dict) -> dict:
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig

    engine = Engine(name, config=EngineConfig(policy=policy))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    matches = []
    for case in r["greedy"]:
        engine.reset()
        got = [c.token for c in engine.generate(case["prompt_tokens"], sp) if c.token is not None]
        want = engine.tokenizer.encode(case["continuation_24"], add_special_tokens=False)
        matches.append(matching_prefix(got, want))
    with engine.swap.phase("prefill"):
        ppl = license_perplexity(engine, r["add_bos"])
    want = r["perplexity_license_c512"]["ppl"]
    return {"model": name, "policy": policy, "greedy_matching_prefix_of_24": matches,
            "ppl": round(ppl.ppl, 4), "ppl_llamacpp": want, "ppl_rel_diff": round(abs(ppl.ppl - want) / want, 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gemma-bits", default="native")
    ap.add_argument("--policy", default=None, help="measure through the engine with this PhaseSwap policy")
    args = ap.parse_args(argv)
    ref = json.loads(REFERENCE.read_text())
    if args.policy:
        for name in ("smollm2", "gemma3"):
            print(json.dumps(engine_row(name, args.policy, ref["models"][KEYS[name]])), flush=True)
        return
    for name, bits in (("smollm2", "native"), ("gemma3", args.gemma_bits)):
        bits = bits if bits in ("exact", "native") else int(bits)
        loaded = load_dense(name, bits)
        r = ref["models"][KEYS[name]]
        tokens_ok = [list(loaded.tokenizer.encode(c["prompt"])) == c["prompt_tokens"] for c in r["greedy"]]
        ppl = license_perplexity(loaded, r["add_bos"])
        want = r["perplexity_license_c512"]["ppl"]
        print(json.dumps({"model": name, "gguf_bits": bits, "prompt_tokens_identical": tokens_ok,
                          "greedy_matching_prefix_of_24": greedy_matches(loaded, r["greedy"]),
                          "ppl": round(ppl.ppl, 4), "ppl_llamacpp": want, "chunks": ppl.chunks,
                          "ppl_rel_diff": round(abs(ppl.ppl - want) / want, 4)}), flush=True)


if __name__ == "__main__":
    main()

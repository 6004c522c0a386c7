"""mx.compile at decode, measured: what MLX's compile does to JustFit's CPU decode step.

    python -m bench.compiled --model smollm2 --context 1024 --steps 48 --rounds 4

Each layer's MLP (the joined gate/up product, the gated activation, the down product)
is compiled with its parameters as implicit inputs, read at every call, so a phase's
swapped weights would be seen. Two caches get the same prompt; in every round one
decodes `steps` greedy tokens plain and the other compiled, in alternating order. The
tokens and the last step's logits must be equal; reported: the first compiled call's
cost (tracing), the median step of each, and the graph-building time alone.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _steps(model, cache, token: int, n: int) -> tuple[list[int], list[float], object]:
    import mlx.core as mx

    tokens, times, logits = [], [], None
    for _ in range(n):
        start = time.perf_counter()
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        token = int(mx.argmax(logits).item())
        times.append(time.perf_counter() - start)
        tokens.append(token)
    return tokens, times, logits


def _build_seconds(model, cache, n: int = 20) -> float:
    """Median time to build one step's graph (evaluated after the clock stops)."""
    import mlx.core as mx

    times = []
    for _ in range(n):
        start = time.perf_counter()
        logits = model(mx.array([[7]]), cache=cache)[0, -1]
        times.append(time.perf_counter() - start)
        mx.eval(logits)
    return statistics.median(times)


def run(model_name: str, context: int, steps: int, rounds: int) -> dict:
    from justfit import runtime

    runtime.setup()
    import mlx.core as mx

    from bench.common import prompt_tokens
    from justfit import Engine
    from justfit.engine.generate import prefill

    engine = Engine(model_name)
    model = engine.model
    mlps = [layer.mlp for layer in model.model.layers]
    mlp_class = type(mlps[0])
    plain_call = mlp_class.__call__
    compiled = {id(m): mx.compile(lambda x, m=m: plain_call(m, x), inputs=m) for m in mlps}

    def compiled_call(self, x):
        fn = compiled.get(id(self))
        return plain_call(self, x) if fn is None else fn(x)

    tokens = prompt_tokens(engine.tokenizer, context)
    caches = {"plain": engine.new_cache(), "compiled": engine.new_cache()}
    first = {name: int(mx.argmax(prefill(model, tokens, c)).item()) for name, c in caches.items()}
    start = time.perf_counter()
    mlp_class.__call__ = compiled_call
    try:
        x = mx.zeros((1, 1, model.args.hidden_size))
        mx.eval([compiled[id(m)](x) for m in mlps])
        trace_s = time.perf_counter() - start
        outs = {"plain": ([], [], None), "compiled": ([], [], None)}
        builds = {}
        for r in range(rounds):
            for name in (("plain", "compiled") if r % 2 == 0 else ("compiled", "plain")):
                mlp_class.__call__ = compiled_call if name == "compiled" else plain_call
                got, times, logits = _steps(model, caches[name], (outs[name][0] or [first[name]])[-1], steps)
                outs[name] = (outs[name][0] + got, outs[name][1] + times, logits)
        for name in ("plain", "compiled"):
            mlp_class.__call__ = compiled_call if name == "compiled" else plain_call
            builds[name] = _build_seconds(model, engine.new_cache())
    finally:
        mlp_class.__call__ = plain_call
    equal = outs["plain"][0] == outs["compiled"][0] and bool(mx.array_equal(outs["plain"][2], outs["compiled"][2]))
    return {"model": model_name, "context": context, "steps": steps * rounds, "trace_s": trace_s,
            "equal": equal, "compiled_layers": len(mlps),
            **{f"{name}_step_ms": statistics.median(outs[name][1]) * 1e3 for name in outs},
            **{f"{name}_build_ms": builds[name] * 1e3 for name in builds}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    import json

    from bench.common import machine_info, save

    row = run(args.model, args.context, args.steps, args.rounds)
    print(json.dumps(row))
    print("saved", save("compiled", {"machine": machine_info(), "systems": [row]}))


if __name__ == "__main__":
    main()

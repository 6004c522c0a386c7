"""One rank of a JustFit engine pipeline (tests/pipeline/test_pipeline.py): each rank an Engine
over its share of the layers (KVExec pages, PhaseSwap residency, its own budget); rank 0
generates greedily and prints JSON: the tokens, and per rank the layers held and the
planner's KV bytes for 4,096 positions. Alone (no mlx.launch): the one-process figures."""

import json
import os
import sys

import mlx.core as mx

from justfit import Engine, SamplingParams

model, budget = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
group = mx.distributed.init(backend="ring") if "MLX_RANK" in os.environ else None
from justfit.config import EngineConfig

config = EngineConfig(**json.loads(os.environ.get("PIPELINE_CONFIG", "{}")))
engine = Engine(model, budget=budget, config=config, group=group)
facts = {"layers": len(engine.swap.registry.layers), "kv_4096": engine.planner.footprint(4096).kv,
         "weights": engine.swap.registry.total_bytes()}
die_after = int(os.environ.get("PIPELINE_DIE_AFTER", "0"))
if group is not None and group.rank() > 0:
    engine.runner.follow(engine, die_after)
    if die_after:
        os._exit(0)  # a rank lost mid-request
    mx.eval(mx.distributed.send(mx.array(list(facts.values()), dtype=mx.int64), 0, group=group))
    sys.exit()
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
if die_after:
    from justfit.errors import PipelineLost

    errors = []
    for _ in range(2):  # the request in flight, then the next: both refused, neither hangs
        try:
            list(engine.generate("The capital of France is", sp))
        except PipelineLost as e:
            errors.append(str(e))
    print(json.dumps({"errors": errors, "lost": engine.runner.lost}))
    os._exit(0)
prompt = "The capital of France is Paris. The capital of Italy is"
tokens = engine.reply(prompt, sp).tokens
# a next turn: what every rank still holds is extended, not computed again
turn = engine.tokenizer.encode(prompt) + tokens + engine.tokenizer.encode(" Madrid is in")
next_turn = engine.reply(turn, sp)
again = engine.reply(prompt + " Rome.", sp)  # starts afresh
out = {"tokens": tokens, "next_turn": next_turn.tokens, "cached": next_turn.stats.cached_tokens,
       "again": again.tokens, "again_cached": again.stats.cached_tokens, "ranks": [facts]}
if group is not None:
    engine.runner.close()
    other = mx.distributed.recv_like(mx.zeros((3,), dtype=mx.int64), 1, group=group).tolist()
    out["ranks"].append(dict(zip(facts, other)))
print(json.dumps(out))

"""One rank of a layer pipeline (run by tests/pipeline/test_pipeline.py under mlx.launch, or
alone for the one-process reference): greedy tokens of a fixed prompt as JSON on
rank 0's stdout. `--die-after N`: the last rank leaves after N forwards (a lost rank)."""

import argparse
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache

from justfit.pipeline import layers as pipeline
from justfit.model.models import load

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--tokens", type=int, default=8)
ap.add_argument("--die-after", type=int, default=0)
args = ap.parse_args()
group = mx.distributed.init(backend="ring") if "MLX_RANK" in os.environ else None
loaded = load(args.model)
model = loaded.model
model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                      model.parameters()))
prompt = [int(t) for t in loaded.tokenizer.encode("The capital of France is Paris. The capital of Italy is")][:24]
prompt = prompt or [1, 2, 3]


def greedy(cache) -> list[int]:
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = []
    for _ in range(args.tokens):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


if group is None:
    print(json.dumps({"tokens": greedy(make_prompt_cache(model))}))
    sys.exit()
split = pipeline.split_layers(len(model.model.layers), [1] * group.size())
link = pipeline.connect(group)
pipeline.keep_share(model, split.layers(group.rank()), link)


def new_cache():
    return pipeline.make_cache(model, make_prompt_cache(model))  # mlx-lm's kinds, then shadows


if group.rank() == 0:
    try:
        tokens = greedy(new_cache())
        pipeline.control(link, pipeline.STOP)
        print(json.dumps({"tokens": tokens, "held_layers": sum(1 for _ in pipeline.held_layers(model))}))
    except (RuntimeError, ConnectionError) as e:  # a lost rank: an error, never a hang
        print(json.dumps({"error": str(e)}))
elif args.die_after and group.rank() == group.size() - 1:
    pipeline.follow(model, link, new_cache, loaded.config["hidden_size"], limit=args.die_after)
    os._exit(0)
else:
    pipeline.follow(model, link, new_cache, loaded.config["hidden_size"])

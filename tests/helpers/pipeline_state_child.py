"""A conversation saved and restored (tests/pipeline/test_pipeline.py), alone or as one rank of a
pipeline: a turn, save, an unrelated request, load, the next turn, save again; then a damaged save
that must be refused with every rank's state unchanged. Rank 0 (or the one process)
prints JSON."""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx

from justfit import Engine, SamplingParams
from statetrans import SnapshotError

model, folder = sys.argv[1], Path(sys.argv[2])
group = mx.distributed.init(backend="ring") if "MLX_RANK" in os.environ else None
engine = Engine(model, group=group)
if group is not None and group.rank() > 0:
    engine.runner.follow(engine)
    sys.exit()
sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def reply(tokens) -> list[int]:
    return engine.reply(tokens, sp).tokens


prompt = engine.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
first = reply(prompt)
saved = engine.save_state(str(folder / "conversation"))
reply(engine.tokenizer.encode("Once upon a time"))  # every rank moves on to something else
loaded = engine.load_state(str(folder / "conversation"))
turn = prompt + first + engine.tokenizer.encode(" Madrid is in")
answer = engine.reply(turn, sp)
second = answer.tokens
engine.save_state(str(folder / "conversation"))  # a new generation replaces the first, on every rank
out = {"first": first, "second": second, "cached": answer.stats.cached_tokens,
       "saved_tokens": saved.tokens, "loaded_tokens": loaded.tokens,
       "parts": sorted(p.name.split("-")[0] for p in (folder / "conversation").iterdir() if p.is_dir())}
out["parts_files"] = sorted(p.name for p in (folder / "conversation").rglob("*") if p.is_file())
# damage the last rank's part (or the one snapshot): refused, nothing changes
arrays = sorted((folder / "conversation").rglob("arrays*.safetensors"))[-1]
data = bytearray(arrays.read_bytes())
data[len(data) // 2] ^= 0xFF
arrays.write_bytes(bytes(data))
try:
    engine.load_state(str(folder / "conversation"))
    out["damaged"] = "loaded"
except SnapshotError as e:
    out["damaged"] = str(e)
third = engine.reply(turn + second + engine.tokenizer.encode(" and"), sp)
out["third"], out["third_cached"] = third.tokens, third.stats.cached_tokens
if group is not None:
    engine.runner.close()
print(json.dumps(out))

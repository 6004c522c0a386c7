"""A pipeline rank that stops answering (tests/pipeline/test_pipeline.py): rank 1 computes three
forwards, then stops itself (SIGSTOP: alive, connection open, silent). Rank 0 runs a
request through the server's Scheduler with a short stall limit and prints JSON: what
the request got and how long it took; then it ends the stopped rank."""

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx

from justfit import Engine, SamplingParams

model, pid_file = sys.argv[1], Path(sys.argv[2])
group = mx.distributed.init(backend="ring")
engine = Engine(model, group=group)
if group.rank() > 0:
    engine.runner.follow(engine, 3)
    pid_file.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)

from justfit.engine.events import End, Failure, Progress, Token  # noqa: E402
from justfit.engine.job import Job  # noqa: E402
from justfit.engine.scheduler import Scheduler  # noqa: E402

KINDS = {Progress: "progress", Token: "chunk", Failure: "error", End: "done"}  # the names the test reads


async def request(scheduler: Scheduler) -> list:
    job = Job(engine.tokenizer.encode("The capital of France is"), SamplingParams(temperature=0, max_tokens=16,
                                                                               ignore_eos=True),
              asyncio.get_running_loop())
    scheduler.submit(job)
    return [(KINDS[type(e)], type(e.error).__name__ if isinstance(e, Failure) else "")
            async for e in job.stream()]


scheduler = Scheduler(engine, stall_s=2.0)
start = time.monotonic()
events = asyncio.run(asyncio.wait_for(request(scheduler), 60))
out = {"events": [k for k, _ in events], "error": next((t for k, t in events if k == "error"), None),
       "seconds": round(time.monotonic() - start, 1), "lost": engine.runner.lost}
print(json.dumps(out), flush=True)
for _ in range(100):  # end the stopped rank, so mlx.launch returns
    if pid_file.exists() and pid_file.read_text():
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        break
    time.sleep(0.1)
os._exit(0)

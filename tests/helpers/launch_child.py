"""One rank under justfit.pipeline.launch (tests/pipeline/test_launch.py): rank 0 sleeps, then sends; rank 1
waits on its Link and prints how long it waited and the CPU time that took. With
`fail` as argument, rank 1 exits 3 at once while rank 0 would sleep a minute."""

import json
import os
import sys
import time

import mlx.core as mx

from justfit.pipeline.link import connect

group = mx.distributed.init()
if sys.argv[1:] == ["fail"]:
    if group.rank() == 1:
        sys.exit(3)
    time.sleep(60)
    sys.exit(0)
link = connect(group)
x = mx.arange(1024, dtype=mx.float32)
if group.rank() == 0:
    time.sleep(2.0)
    link.send(x * 2, 1)
    os.write(1, (json.dumps({"back": link.recv_like(x, 1).sum().item()}) + "\n").encode())
else:
    wall, cpu = time.monotonic(), time.process_time()
    got = link.recv_like(x, 0)
    # one write per line: both ranks share this stdout
    os.write(1, (json.dumps({"waited_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu,
                             "doorbells": link.out is not None}) + "\n").encode())
    link.send(got + 1, 0)

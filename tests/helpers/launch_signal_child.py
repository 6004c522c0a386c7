"""One rank under justfit.pipeline.launch for tests/pipeline/test_launch.py, without MLX: prints its rank
and the stop signals it ignores, then waits. Rank 0, on SIGTERM, leaves a file FLAG
(as a server tells its followers STOP) and exits 0, or with `stuck` ignores it (a stop
that never ends); the others leave once FLAG exists."""

import json
import os
import signal
import sys
import time
from pathlib import Path

flag, stuck = Path(sys.argv[1]), sys.argv[2:] == ["stuck"]
rank = int(os.environ["MLX_RANK"])
ignored = [s.name for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_IGN]
if rank == 0:
    def stop(*_):
        flag.write_text("stop")
        sys.exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if stuck else stop)
# one write per line: two ranks share this stdout, and print() unbuffered writes the
# newline apart from the line
os.write(1, (json.dumps({"rank": rank, "ignores": ignored}) + "\n").encode())
while rank == 0 or not flag.exists():
    time.sleep(0.02)

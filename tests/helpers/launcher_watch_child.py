"""A rank-like process for tests/pipeline/test_rank_lifecycle.py: watches the launcher's pipe
(justfit.pipeline.launch.watch_launcher), says so, then waits to be ended."""

import time

from justfit.pipeline.launch import watch_launcher

watch_launcher()
print("watching", flush=True)
time.sleep(60)

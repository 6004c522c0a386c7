"""The child of tests/model/test_first_load.py: a fresh process predicts a model's first load,
then loads it under a whole-process budget and prints, as one JSON line, the prediction
and its own peak while loading (VmHWM, reset just before).

    python -m tests.helpers.first_load_child MODEL BUDGET_BYTES
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, budget = sys.argv[1], int(sys.argv[2])
    from justfit import runtime

    runtime.setup()
    from justfit.config import EngineConfig
    from justfit.engine.facade import Engine
    from justfit.errors import FirstLoadExceeded
    from justfit.memory import peak_rss_bytes
    from kvexec import KVConfig

    config = EngineConfig(budget_bytes=budget, budget_covers_process=True, kv=KVConfig(format="calibrated"))
    predicted = Engine.first_load(model, config)
    with open("/proc/self/clear_refs", "w") as f:  # the kernel's high-water mark from here on
        f.write("5")
    out = {"predicted": predicted.peak, "parts": predicted.parts()}
    try:
        Engine(model, config=config)
        out["loaded"] = True
    except FirstLoadExceeded as e:
        out.update(refused=str(e), refused_peak=e.peak)
    out["peak_rss"] = peak_rss_bytes()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

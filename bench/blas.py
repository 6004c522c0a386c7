"""The effect of preloading OpenBLAS on MLX's CPU backend: a 2048x2048 fp32 matmul
and a SmolLM2 prefill, each in a fresh process with and without the preload.

    python -m bench.blas
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _worker() -> dict:
    from justfit import runtime

    runtime.setup()  # preloads OpenBLAS unless JUSTFIT_BLAS=off
    import mlx.core as mx

    from justfit import Engine, SamplingParams
    from justfit.blas import active_blas

    a, b = mx.random.normal((2048, 2048)), mx.random.normal((2048, 2048))
    mx.eval(a @ b)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - start)
    engine = Engine("smollm2")
    from bench.common import prompt_tokens

    stats = engine.reply(prompt_tokens(engine.tokenizer, 1024), SamplingParams(temperature=0, max_tokens=1)).stats
    return {"blas": active_blas(), "matmul_2048_s": min(times), "prefill_1k_tps": stats.prefill_tps}


def main(argv: list[str] | None = None) -> dict:
    if "--worker" in (sys.argv if argv is None else argv):
        print(json.dumps(_worker()))
        return {}
    rows = []
    for preload in ("on", "off"):
        env = dict(os.environ, JUSTFIT_BLAS="" if preload == "on" else "off")
        out = subprocess.run([sys.executable, "-m", "bench.blas", "--worker"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append({"openblas_preload": preload, **json.loads(out)})
        print(json.dumps(rows[-1]), flush=True)
    on, off = rows
    print(f"matmul speedup {off['matmul_2048_s'] / on['matmul_2048_s']:.1f}x, "
          f"prefill speedup {on['prefill_1k_tps'] / off['prefill_1k_tps']:.1f}x")
    return {"rows": rows}


if __name__ == "__main__":
    main()

"""llama.cpp's own speed on the same GGUF, through its `llama-bench` binary."""

from __future__ import annotations

import json
import subprocess


def llama_bench(binary: str, model: str, contexts: list[int], decode: int, repeat: int) -> list[dict]:
    """One row per context: prompt processing (pp) and generation (tg) rates, or an error row."""
    from justfit.models import EMBEDDED

    gguf = str(EMBEDDED[model]()) if model in EMBEDDED else model
    rows = []
    for context in contexts:
        row = {"system": "llama.cpp", "model": model, "context": context, "decode_tokens": decode}
        cmd = [binary, "-m", gguf, "-p", str(context), "-n", str(decode), "-r", str(repeat), "-o", "json"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True).stdout
            tests = json.loads(out)
            pp = next(t for t in tests if t.get("n_prompt") == context and not t.get("n_gen"))
            tg = next(t for t in tests if t.get("n_gen") == decode and not t.get("n_prompt"))
            row.update(prefill_tps=pp["avg_ts"], decode_tps=tg["avg_ts"], ttft_s=context / pp["avg_ts"])
        except (OSError, subprocess.SubprocessError, ValueError, StopIteration, KeyError) as e:
            row["error"] = f"llama-bench failed: {e}"
        rows.append(row)
    return rows

"""The capacity bench's llama.cpp rows (bench.capacity): per budget, the largest
context llama.cpp reserves within it, checked against full passes."""

from __future__ import annotations

import json


def llama_rows(system: str, args, budgets: list[int]) -> list[dict]:
    """llama.cpp rows: per budget, the largest n_ctx whose reserved memory plus compute
    buffer fits (bench.llamacpp.reserve_edge; `--repeats` times at the smallest budget),
    checked against full passes at `--llama-validate` contexts."""
    from bench.capacity_rows import row_at
    from bench.llamacpp import reserve_edge, validate

    setup = {"trained_context": trained_context(args.model), "blas": "llama.cpp's own (ggml CPU)"}
    checks = [int(n) for n in (args.llama_validate or "").split(",") if n]
    checked = validate(args.llama_cpp or "", system, args.model, checks, args.out, args.max_seconds) if checks else []
    rows = []
    for i, budget in enumerate(budgets):
        runs = [reserve_edge(args.llama_cpp or "", system, args.model, budget, args.max_positions)
                for _ in range(args.repeats if i == 0 else 1)]
        steps, end = runs[0]
        run = {"setup": setup, "steps": steps, "end": {"end": "crashed" if end.startswith("error") else end}}
        if end.startswith("error"):
            run["error"] = end[len("error: "):]
        row = row_at(system, args, budget, run)
        if len(runs) > 1:
            got = [row_at(system, args, budget, {"setup": setup, "steps": st, "end": {"end": e}}).get("positions")
                   for st, e in runs]
            ok = [g for g in got if g is not None]
            row.update(repeat_positions=got, **({"min_positions": min(ok), "max_positions": max(ok)} if ok else {}))
        last = next((s for s in reversed(steps) if s["positions"] == row.get("positions")), None)
        if last:
            row.update({k: last[k] for k in ("kv_bytes_per_position", "kv_buffer_mib", "compute_buffer_mib",
                                              "reserved_rss", "method")})
        if checked:
            row["validation"] = checked
        rows.append(row)
    return rows


def trained_context(model: str) -> int | None:
    """The model's trained context from its converted config (None if unknown)."""
    from pathlib import Path

    from justfit.model.models import resolve

    try:
        config = Path(resolve(model)) / "config.json"
        return json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None

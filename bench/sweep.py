"""The capacity budget sweep: budget presets per model, and the headline ratios at
each budget (JustFit rows of equal fidelity over each baseline)."""

from __future__ import annotations

# Budgets per model, whole process: from just above what the weights and a first chunk
# need to where the smaller systems hold tens of thousands of positions.
PRESETS = {
    "smollm2": "400,550,800,1100,1600MiB",
    "gemma3": "1100,1300,1600,2000,2400MiB",  # from just above what JustFit's load alone peaks at
}
BASELINES = ("mlx-lm", "mlx-lm-tuned", "llama.cpp", "llama.cpp-q8_0")


def parse_budgets(spec: str, model: str) -> list[str]:
    """'400,550MiB' -> ['400MiB', '550MiB']; 'preset' -> the model's preset."""
    if spec == "preset":
        if model not in PRESETS:
            raise ValueError(f"no budget preset for {model}; give --budgets, e.g. {PRESETS['smollm2']}")
        spec = PRESETS[model]
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    unit = next((p.lstrip("0123456789.") for p in reversed(parts) if p.lstrip("0123456789.")), "")
    return [p if p.lstrip("0123456789.") else p + unit for p in parts]


def held(row: dict) -> tuple[int | None, str]:
    """A row's positions and how they are known: measured, at least (a limited run),
    or modeled (a run that could not reach the budget in its time); over repeated
    runs, the fewest."""
    if row.get("modeled_positions") is not None:
        return row["modeled_positions"], "modeled"
    if "positions" in row:  # over repeated runs, the fewest: a ratio holds in every run
        n = row["min_positions"] if row.get("min_positions") is not None else row["positions"]
        return n, "at least" if row.get("limited") else "measured"
    return None, ""


def headline(rows: list[dict]) -> list[dict]:
    """Per budget: the JustFit row holding the most positions among those eligible
    (`headline` == "eligible"), and its ratio over each baseline at that budget."""
    out = []
    for budget in sorted({r["budget_mib"] for r in rows}):
        here = [r for r in rows if r["budget_mib"] == budget]
        best = max((r for r in here if r["system"].startswith("justfit") and r.get("headline") == "eligible"),
                   key=lambda r: held(r)[0] or 0, default=None)
        line = {"budget_mib": budget, "justfit": best["system"] if best else None,
                "positions": held(best)[0] if best else None}
        for name in BASELINES:
            base = next((r for r in here if r["system"] == name), None)
            line[name] = ratio(best, base) if best and base else ""
        out.append(line)
    return out


def ratio(row: dict, base: dict) -> str:
    """row's positions over base's, saying how far the runs bound it (a limited run
    holds at least its figure; a modeled one is marked)."""
    (a, how_a), (b, how_b) = held(row), held(base)
    if not a or not b:
        return ""
    if row is base:
        return "1.00x"
    text = f"{a / b:.2f}x"
    if how_a == "at least" and how_b == "at least":
        return "unknown (both limited)"
    if how_a == "at least":
        text = ">= " + text
    elif how_b == "at least":
        text = "<= " + text
    return text + (" (modeled)" if "modeled" in (how_a, how_b) else "")

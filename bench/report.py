"""Results as people read them: markdown tables and PNG plots, written beside the
JSON every benchmark saves (bench/results/NAME-TIME.{json,md,png})."""

from __future__ import annotations


def _machine_line(m: dict) -> str:
    return (f"{m.get('cpu')} x{m.get('cores')}, {m.get('memory_gib')} GiB, MLX {m.get('mlx')} "
            f"({m.get('mlx_backend')}), mlx-lm {m.get('mlx_lm')}, BLAS {m.get('blas')}, commit {m.get('commit')}, "
            f"{m.get('date')}")


def capacity_ratio(row: dict, base: dict | None) -> str:
    """row's positions over base's, as far as the two runs bound it: a run that hit
    the clock or the position limit holds at least its figure, so over an exact
    figure the ratio is a lower bound, under one an upper bound, and between two
    such runs unknown."""
    if not base or not base.get("positions") or "positions" not in row:
        return ""
    ratio = f"{row['positions'] / base['positions']:.2f}x"
    if row is base:
        return ratio
    low, high = bool(row.get("limited")), bool(base.get("limited"))
    return {(False, False): ratio, (True, False): ">= " + ratio, (False, True): "<= " + ratio,
            (True, True): "unknown (both limited)"}[(low, high)]


def capacity_markdown(result: dict) -> str:
    s, rows = result["settings"], result["systems"]
    base = {r["system"]: r for r in rows}
    lines = [f"# Capacity: {s['model']}, whole-process budget {s['budget']}", "",
             f"Steps of {s['step']} input tokens + {s['out']} generated; machine: {_machine_line(result['machine'])}",
             *([f"Rows combined from {', '.join(s['combined_from'])} (each row's `source`)."]
               if s.get("combined_from") else []),
             "", "| system | retained positions | peak (MiB) | x mlx-lm | x mlx-lm-kv4 | ended by | KV pages |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "positions" not in r:
            lines.append(f"| {r['system']} | error: {r.get('error', '')} | | | | {r.get('ended_by', '')} | |")
            continue
        ratios = [capacity_ratio(r, base.get(b)) for b in ("mlx-lm", "mlx-lm-kv4")]
        more = " (limit: at least this)" if r.get("limited") else ""
        pages = ", ".join(f"{k} {v:.0%}" for k, v in (r.get("kv_formats") or {}).items()) or r.get("note", "")
        lines.append(f"| {r['system']} | {r['positions']:,}{more} | {r['peak_mib']:.0f} | {ratios[0]} | "
                     f"{ratios[1]} | {r['ended_by']} | {pages} |")
    return "\n".join(lines) + "\n"


def capacity_plot(result: dict, path) -> bool:
    """Peak memory vs retained positions per system, the budget as a line. False
    (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = result["settings"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in result["systems"]:
        if r.get("curve"):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker=".", label=r["system"])
    budget = result["systems"][0].get("budget_mib") if result["systems"] else None
    if budget:
        ax.axhline(budget, color="red", linestyle="--", label=f"budget {s['budget']}")
    ax.set_xlabel("retained positions (input + generated)")
    ax.set_ylabel("whole-process peak memory (MiB)")
    ax.set_title(f"Capacity: {s['model']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _table(title: str, result: dict, columns: str, second: str, cells) -> str:
    """`columns` ("name:align | ..."), one row per system from `cells(row)`; a failed
    system's row names it, its `second` field and the error."""
    names, aligns = zip(*(c.strip().split(":") for c in columns.split("|")))
    lines = [f"# {title}; machine: {_machine_line(result['machine'])}", "", "| " + " | ".join(names) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in aligns) + "|"]
    for r in result["systems"]:
        row = [r["system"], str(r.get(second, "")), f"error: {r['error']}"] if "error" in r else cells(r)
        lines.append("| " + " | ".join(row + [""] * (len(names) - len(row))) + " |")
    return "\n".join(lines) + "\n"


def speed_markdown(result: dict) -> str:
    return _table("Speed", result, "system:l | context:r | prefill tok/s:r | decode tok/s:r | TTFT s:r | "
                  "peak MiB:r | runs:r", "context", lambda r: [
                      r["system"], str(r["context"]), f"{r['prefill_tps']:.1f}", f"{r['decode_tps']:.2f}",
                      f"{r['ttft_s']:.2f}", f"{r['peak_mib']:.0f}" if "peak_mib" in r else "", str(r.get("runs", ""))])


def quality_markdown(result: dict) -> str:
    def num(r: dict, k: str, fmt: str) -> str:
        return format(r[k], fmt) if k in r else ""

    return _table("KV fidelity", result, "system:l | format:l | tokens / context:r | top-1:r | KL:r | ppl:r | "
                  "pass-key:r", "format", lambda r: [
                      r["system"], r.get("format", ""), str(r.get("tokens", r.get("context", ""))),
                      num(r, "top1", ".4f"), num(r, "kl", ".2e"), num(r, "ppl", ".3f"),
                      f"{r['passkey_hits']}/{r['passkey_trials']}" if "passkey_hits" in r else ""])


def write_views(suite: str, path, result: dict) -> bool:
    """The markdown table (and a capacity run's plot) beside the JSON at `path`; False
    when the suite has no table."""
    from pathlib import Path

    views = {"capacity": (capacity_markdown, capacity_plot), "speed": (speed_markdown, None),
             "quality": (quality_markdown, None)}
    if suite not in views:
        return False
    markdown, plot = views[suite]
    path = Path(path)
    path.with_suffix(".md").write_text(markdown(result))
    if plot:
        plot(result, path.with_suffix(".png"))
    return True


def render(path) -> None:
    """Rewrite the views beside a saved result, e.g. after this module changed:
    `python -m bench.report bench/results/*.json`."""
    import json
    from pathlib import Path

    result = json.loads(Path(path).read_text())
    if "systems" in result and "machine" in result:  # else saved before the output contract
        write_views(Path(path).name.split("-")[0], path, result)


# What capacity runs must share for their rows to stand in one table.
_SAME_RUN = ("model", "budget", "step", "out", "refine")
_SAME_MACHINE = ("cpu", "cores", "memory_gib", "mlx", "mlx_backend", "mlx_lm", "blas")


def combine_capacity(paths) -> dict:
    """One capacity result from runs made apart (a system rerun with a higher position
    or time limit): each system's row from the last file that has it, tagged with that
    file. The runs must share model, budget, steps and machine, else ValueError."""
    import json
    from pathlib import Path

    results = [(Path(p).name, json.loads(Path(p).read_text())) for p in paths]
    first = results[0][1]
    rows: dict[str, dict] = {}
    for name, r in results:
        for keys, a, b, what in ((_SAME_RUN, first["settings"], r["settings"], "settings"),
                                 (_SAME_MACHINE, first["machine"], r["machine"], "machine")):
            differ = [k for k in keys if a.get(k) != b.get(k)]
            if differ:
                raise ValueError(f"{name}: {what} differ from {results[0][0]}'s in {', '.join(differ)}")
        for row in r["systems"]:
            rows[row["system"]] = {**row, "source": name}
    settings = {**first["settings"], "combined_from": [name for name, _ in results]}
    return {"machine": first["machine"], "settings": settings, "systems": list(rows.values())}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Rewrite the views beside saved results; or, with "
                                             "--combine, save one capacity result from several runs.")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--combine", action="store_true")
    args = ap.parse_args()
    if args.combine:
        from bench.common import publish

        publish("capacity", combine_capacity(args.files), False)
    else:
        for name in args.files:
            render(name)

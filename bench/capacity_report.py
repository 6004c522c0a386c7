"""Capacity results as people read them: the headline (equal-fidelity ratios at
every budget), one table per budget, the fitted memory models, and a plot of
positions vs budget (log y; modeled points hollow)."""

from __future__ import annotations

from bench.common import machine_line
from bench.sweep import BASELINES, held, ratio


def capacity_ratio(row: dict, base: dict | None) -> str:
    """row's positions over base's, as far as the two runs bound it: a run that hit
    the clock or the position limit holds at least its figure, so over an exact
    figure the ratio is a lower bound, under one an upper bound, and between two
    such runs unknown; a modeled figure is marked."""
    return ratio(row, base) if base else ""


def _positions(r: dict) -> str:
    n, how = held(r)
    text = f"{r['positions']:,}" if "positions" in r else ""
    if how == "modeled":
        text = f"{n:,} modeled (measured >= {r['positions']:,}, error {r['memory_model']['error_mib']:.1f} MiB)"
    elif how == "at least":
        text += " (limit: at least this)"
    if r.get("planned_positions") is not None:
        text += f" (planner predicted {r['planned_positions']:,})"
    if r.get("min_positions") is not None:
        text += f" [min {r['min_positions']:,}, max {r['max_positions']:,} of {len(r['repeat_positions'])} runs]"
    return text


def _kv(r: dict) -> str:
    pages = ", ".join(f"{k} {v:.0%}" for k, v in (r.get("kv_formats") or {}).items())
    kind = pages or r.get("kv_dtype", "")
    if r.get("kv_bits"):
        kind += f" ({r['kv_bits']}-bit)"
    return kind + (f"; {r['note']}" if r.get("note") else "")


def _fidelity(r: dict) -> str:
    f = r.get("fidelity") or {}
    if "top1" in f:
        return f"{f['top1']:.2%} ({f['spec']})"
    return f.get("error", "")


def _marks(r: dict) -> str:
    marks = [] if r.get("headline") in (None, "eligible") else [r["headline"]]
    if r.get("past_trained_context"):
        marks.append(f"past trained context {r['trained_context']:,}")
    if r.get("streamed_from_disk"):  # weights the others keep in memory, read from disk each step
        marks.append(f"{len(r['streamed_from_disk'])} weight components streamed from disk")
    return "; ".join(marks)


def capacity_markdown(result: dict) -> str:
    s, rows = result["settings"], result["systems"]
    plural = "s" if len(s.get("budgets") or []) > 1 else ""
    lines = [f"# Capacity: {s['model']}, whole-process budget{plural} {s['budget']}", "",
             f"Steps of {s['step']} input tokens + {s['out']} generated; machine: {machine_line(result['machine'])}",
             *([f"Rows combined from {', '.join(s['combined_from'])} (each row's `source`)."]
               if s.get("combined_from") else [])]
    if result.get("headline"):
        lines += ["", "## Headline: JustFit at top-1 >= 99% (its format mix vs float16 pages)", "",
                  "| budget MiB | JustFit system | positions | " + " | ".join(f"x {b}" for b in BASELINES) + " |",
                  "|---:|---|---:|" + "---:|" * len(BASELINES)]
        for h in result["headline"]:
            pos = f"{h['positions']:,}" if h.get("positions") else "none eligible"
            lines.append(f"| {h['budget_mib']:.0f} | {h['justfit'] or ''} | {pos} | "
                         + " | ".join(h.get(b, "") for b in BASELINES) + " |")
    for budget in sorted({r.get("budget_mib") or 0 for r in rows}):
        here = [r for r in rows if (r.get("budget_mib") or 0) == budget]
        base = {r["system"]: r for r in here}
        lines += ["", f"## Budget {budget:.0f} MiB" if budget else "", "",
                  "| system | retained positions | peak MiB | " + " | ".join(f"x {b}" for b in BASELINES)
                  + " | ended by | KV | top-1 | prefill step | weights | BLAS | marks |",
                  "|---|---:|---:|" + "---:|" * len(BASELINES) + "---|---|---:|---:|---|---|---|"]
        for r in here:
            if "positions" not in r:
                lines.append(f"| {r['system']} | error: {r.get('error', '')} | | " + " | " * len(BASELINES)
                             + f"{r.get('ended_by', '')} | | | | | | |")
                continue
            ratios = [capacity_ratio(r, base.get(b)) for b in BASELINES]
            lines.append(f"| {r['system']} | {_positions(r)} | {r['peak_mib']:.0f} | " + " | ".join(ratios)
                         + f" | {r['ended_by']} | {_kv(r)} | {_fidelity(r)} | {r.get('prefill_step', '')} | "
                         f"{r.get('weights_dtype', '')} | {r.get('blas', '')} | {_marks(r)} |")
    models = [r for r in rows if r.get("memory_model")]
    if models:
        lines += ["", "## Fitted memory models (stock runs that could not reach the budget in their time)", "",
                  "| system | budget MiB | measured in steps of | stated at steps of | baseline MiB | weights MiB "
                  "| KV B/pos | transient B/pos | fitted const MiB | points | max error MiB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in models:
            m = r["memory_model"]
            lines.append(f"| {r['system']} | {r['budget_mib']:.0f} | {r.get('measured_step_tokens', s['step'])} | "
                         f"{r.get('modeled_step_tokens', s['step'])} | {m['baseline_mib']} | {m['weights_mib']} | "
                         f"{m['kv_bytes_per_position']:.0f} | {m['transient_bytes_per_position']:.0f} | "
                         f"{m['constant_mib']} | {m['points']} | {m['error_mib']} |")
    checked = next((r["model_check"] for r in rows if r.get("model_check")), None)
    if checked:
        lines += _check_lines(checked)
    return "\n".join(lines) + "\n"


def _check_lines(c: dict) -> list[str]:
    """The modeling procedure checked on a system fast enough to measure both ways."""
    lines = ["", f"## The modeling checked: {c['system']} fitted to {c['memory_model']['points']} steps of "
                 f"{c['measured_step_tokens']} tokens, against its measured steps of {c['step_tokens']}", "",
             "| positions | measured peak MiB | modeled MiB | error MiB |", "|---:|---:|---:|---:|"]
    lines += [f"| {p['positions']:,} | {p['measured_mib']} | {p['modeled_mib']} | {p['error_mib']:+} |"
              for p in c["points"]]
    lines += ["", "| budget MiB | modeled positions | measured positions | measured is |", "|---:|---:|---:|---|"]
    lines += [f"| {k['budget_mib']:.0f} | {k['modeled']:,} | {k['measured']:,} | {k['measured_is']} |"
              for k in c["capacities"]]
    return lines


def capacity_plot(result: dict, path) -> bool:
    """Positions vs budget per system (log y; modeled points hollow) for a sweep, or
    peak memory vs positions for one budget. False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s, rows = result["settings"], result["systems"]
    fig, ax = plt.subplots(figsize=(8, 5))
    if len(s.get("budgets") or []) > 1:
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = [(r["budget_mib"], *held(r)) for r in rows if r["system"] == system and held(r)[0]]
            if not pts:
                continue
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
            hollow = [p for p in pts if p[2] == "modeled"]
            if hollow:
                ax.plot([p[0] for p in hollow], [p[1] for p in hollow], "o", mfc="white", color=line.get_color(),
                        label=f"{system} (modeled)")
        ax.set_yscale("log")
        ax.set_xlabel("whole-process budget (MiB)")
        ax.set_ylabel("retained positions (log)")
    else:
        for r in rows:
            if r.get("curve"):
                xs, ys = zip(*r["curve"])
                ax.plot(xs, ys, marker=".", label=r["system"])
        budget = rows[0].get("budget_mib") if rows else None
        if budget:
            ax.axhline(budget, color="red", linestyle="--", label=f"budget {s['budget']}")
        ax.set_xlabel("retained positions (input + generated)")
        ax.set_ylabel("whole-process peak memory (MiB)")
    ax.set_title(f"Capacity: {s['model']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

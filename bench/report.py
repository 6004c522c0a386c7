"""Results as people read them: markdown tables and PNG plots, written beside the
JSON every benchmark saves (bench/results/NAME-TIME.{json,md,png})."""

from __future__ import annotations


def _machine_line(m: dict) -> str:
    return (f"{m.get('cpu')} x{m.get('cores')}, {m.get('memory_gib')} GiB, MLX {m.get('mlx')} "
            f"({m.get('mlx_backend')}), mlx-lm {m.get('mlx_lm')}, BLAS {m.get('blas')}, commit {m.get('commit')}, "
            f"{m.get('date')}")


def capacity_markdown(result: dict) -> str:
    s, rows = result["settings"], result["systems"]
    base = {r["system"]: r.get("positions") for r in rows}
    lines = [f"# Capacity: {s['model']}, whole-process budget {s['budget']}", "",
             f"Steps of {s['step']} input tokens + {s['out']} generated; machine: {_machine_line(result['machine'])}",
             "", "| system | retained positions | peak (MiB) | x mlx-lm | x mlx-lm-kv4 | ended by | KV pages |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "positions" not in r:
            lines.append(f"| {r['system']} | error: {r.get('error', '')} | | | | {r.get('ended_by', '')} | |")
            continue
        ratios = [f"{r['positions'] / base[b]:.2f}x" if base.get(b) else "" for b in ("mlx-lm", "mlx-lm-kv4")]
        more = " (limit: at least this)" if r.get("limited") else ""
        pages = ", ".join(f"{k} {v:.0%}" for k, v in (r.get("kv_formats") or {}).items())
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

"""Results as people read them: markdown tables and PNG plots, written beside the
JSON every benchmark saves (bench/results/NAME-TIME.{json,md,png}; `publish` does
both); and, run with no files, the docs' results table (bench.summary) and
bench/results/INDEX.md (bench.results_index), both from the saved JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.capacity_report import capacity_markdown, capacity_plot, capacity_ratio  # noqa: F401  (views by suite)
from bench.common import machine_line, save


def _table(title: str, result: dict, columns: str, second: str, cells) -> str:
    """`columns` ("name:align | ..."), one row per system from `cells(row)`; a failed
    system's row names it, its `second` field and the error."""
    names, aligns = zip(*(c.strip().split(":") for c in columns.split("|")))
    lines = [f"# {title}; machine: {machine_line(result['machine'])}", "", "| " + " | ".join(names) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in aligns) + "|"]
    for r in result["systems"]:
        row = [r["system"], str(r.get(second, "")), f"error: {r['error']}"] if "error" in r else cells(r)
        lines.append("| " + " | ".join(row + [""] * (len(names) - len(row))) + " |")
    return "\n".join(lines) + "\n"


def _with_range(r: dict, key: str, fmt: str) -> str:
    """A rate's median, with its range over the rounds where there were several."""
    if key not in r:
        return "-"
    spread = f" ({r[key + '_min']:{fmt}}-{r[key + '_max']:{fmt}})" if r.get("runs", 1) > 1 and key + "_min" in r else ""
    return f"{r[key]:{fmt}}{spread}"


def speed_markdown(result: dict) -> str:
    bw = result.get("read_bandwidth_gbs")
    title = "Speed" + (f" (decode floor: MiB read per token at {max(bw):.1f} GB/s, the best streaming read "
                       f"of {', '.join(map(str, bw))} GB/s measured before and after)" if bw else "")
    if result.get("disk_read_gbs"):
        title += f"; disk bound: KV pages on disk read once a token at {result['disk_read_gbs']} GB/s (cold)"
    depth = (result.get("settings") or {}).get("depth")
    table = _table(title, result, "system:l | context:r | drafts:l | prefill tok/s:r | decode tok/s:r | TTFT s:r | "
                   "peak MiB:r | MiB read/token:r | floor tok/s:r | of floor:r | disk bound tok/s:r | of it:r | "
                   "runs:r", "context", lambda r: [
                       r["system"], f"{r['context']}{f' after {depth:,}' if depth else ''}"
                       f"{' (synthetic)' if r.get('synthetic') else ''}", str(r.get("drafts", "-")),
                       _with_range(r, "prefill_tps", ".1f"), _with_range(r, "decode_tps", ".2f"),
                       f"{r['ttft_s']:.2f}" if r.get("ttft_s") is not None else "-",
                       f"{r['peak_mib']:.0f}" if "peak_mib" in r else "",
                       str(r.get("read_mib_per_token", "")), str(r.get("floor_tps", "")),
                       f"{r['floor_fraction']:.0%}" if "floor_fraction" in r else "", str(r.get("io_bound_tps", "")),
                       f"{r['io_bound_fraction']:.0%}" if "io_bound_fraction" in r else "", str(r.get("runs", ""))])
    if result.get("ratios"):  # per round, the two runs of that round; median and range over the rounds
        table += "\n| ratio | context | rate | median | min-max | rounds |\n|---|---:|---|---:|---:|---:|\n"
        table += "".join(f"| {q['system']} / {q['over']} | {q['context']} | {q['rate']} | {q['median']:.3f} | "
                         f"{q['min']:.3f}-{q['max']:.3f} | {q['n']} |\n" for q in result["ratios"])
    return table


def quality_markdown(result: dict) -> str:
    def num(r: dict, k: str, fmt: str) -> str:
        return format(r[k], fmt) if k in r else ""

    # bits/value over every layer, and over the layers holding every position where
    # sliding-window layers (whose pages stop at the window) have other formats
    return _table("KV fidelity", result, "system:l | format:l | bits/value:r | bits/value, full layers:r | "
                  "tokens / context:r | top-1:r | KL:r | ppl:r | ppl delta:r | pass-key:r", "format", lambda r: [
                      r["system"], r.get("format", ""), num(r, "bits_per_value", ".3f"),
                      num(r, "bits_per_value_growing", ".3f"),
                      str(r.get("tokens", r.get("context", ""))),
                      num(r, "top1", ".4f"), num(r, "kl", ".2e"), num(r, "ppl", ".3f"), num(r, "ppl_delta", "+.3%"),
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


def publish(name: str, result: dict, as_json: bool) -> Path:
    """Save `result` (JSON, plus its markdown table and plot where the suite has them,
    `write_views`), then print it as one JSON object on stdout (--json) or say where it
    went."""
    path = save(name, result)
    viewed = write_views(name, path, result)
    if as_json:
        print(json.dumps(result))
    else:
        print(f"saved {path}" + (" (+ .md)" if viewed else ""), file=sys.stderr)
    return path


def render(path) -> None:
    """Rewrite the views beside a saved result, e.g. after this module changed:
    `python -m bench.report bench/results/*.json`."""
    import json
    from pathlib import Path

    result = json.loads(Path(path).read_text())
    if "systems" in result and "machine" in result:  # else saved before the output contract
        write_views(Path(path).name.split("-")[0], path, result)


# What capacity runs must share for their rows to stand in one table (limits, refine
# and repeats may differ: each row names its `source` file, whose settings say them).
_SAME_RUN = ("model", "step", "out")
_SAME_MACHINE = ("cpu", "cores", "mlx", "mlx_backend", "mlx_lm", "blas")  # and memory within 2%


def combine_capacity(paths) -> dict:
    """One capacity result (a sweep) from runs made apart (systems or budgets run
    separately, or rerun with a higher limit): each (system, budget) row from the last
    file that has it, tagged with that file, and the headline over them all. The runs
    must share model, step sizes and machine, else ValueError."""
    import json
    from pathlib import Path

    from bench.sweep import headline

    results = [(Path(p).name, json.loads(Path(p).read_text())) for p in paths]
    first = results[0][1]
    rows: dict[tuple, dict] = {}
    for name, r in results:
        for keys, a, b, what in ((_SAME_RUN, first["settings"], r["settings"], "settings"),
                                 (_SAME_MACHINE, first["machine"], r["machine"], "machine")):
            differ = [k for k in keys if a.get(k) != b.get(k)]
            if what == "machine" and abs((a.get("memory_gib") or 0) - (b.get("memory_gib") or 0)) \
                    > 0.02 * (a.get("memory_gib") or 0):
                differ.append("memory_gib")  # a fresh machine of the same kind reports a few MiB less
            if differ:
                raise ValueError(f"{name}: {what} differ from {results[0][0]}'s in {', '.join(differ)}")
        for row in r["systems"]:
            rows[row["system"], row.get("budget_mib")] = {**row, "source": name}
    budgets = sorted({b for _, b in rows if b is not None})
    names = [f"{b:g}MiB" for b in budgets]
    settings = {**first["settings"], "budget": ",".join(names), "budgets": names,
                "combined_from": [name for name, _ in results],
                "sources": {name: r["settings"] for name, r in results},
                "machines": {name: r["machine"] for name, r in results}}
    combined = list(rows.values())
    for row in combined:
        _remodel(row)
    _share_fidelity(combined)
    return {"machine": first["machine"], "settings": settings, "systems": combined, "headline": headline(combined)}


def _remodel(row: dict) -> None:
    """A row stopped by its clock, modeled again from its saved steps (so a corrected
    term, e.g. a newly measured attention transient, reaches rows already run)."""
    from bench.capacity_model import model_row
    from bench.capacity_rows import modelable

    if row.get("ended_by") != "time limit" or not row.get("steps") or "positions" not in row \
            or not modelable(row["system"], row):
        return
    for key in ("modeled_positions", "modeled", "memory_model"):
        row.pop(key, None)
    setup = {k: row[k] for k in ("shape", "baseline_rss", "weights_bytes") if k in row}
    run = {"setup": setup, "steps": row["steps"]}
    model_row(row, run, int(row["budget_mib"] * 2**20), row.get("measured_step_tokens", row["step_tokens"]),
              row["step_tokens"])


def _share_fidelity(rows: list[dict]) -> None:
    """A JustFit row run with --fidelity-tokens 0 takes the fidelity measured for the
    same page mix (spec) in another run; then every row's marks are set again."""
    from bench.fidelity import mark, mix_distance

    measured = {f["spec"]: f for r in rows if "top1" in (f := r.get("fidelity") or {})}
    for r in rows:
        f = r.get("fidelity") or {}
        if "top1" not in f and f.get("spec") in measured:
            got = {**measured[f["spec"]], "shared_from_another_row": True}
            if got.get("measured_mix") and r.get("kv_formats"):
                got["mix_distance"] = round(mix_distance(got["measured_mix"], r["kv_formats"]), 3)
            r["fidelity"] = got
        mark(r)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="With no files: rewrite the results table in README.md and "
                                             "docs/BENCHMARKS.md and bench/results/INDEX.md from the saved JSON. "
                                             "With files: rewrite the views beside them; or, with --combine, "
                                             "save one capacity result from several runs.")
    ap.add_argument("files", nargs="*")
    ap.add_argument("--combine", action="store_true")
    args = ap.parse_args()
    if not args.files:
        if args.combine:
            ap.error("--combine needs the result files to combine")
        from bench import results_index, summary

        for doc in summary.write():
            print(f"rewrote the results table in {doc}")
        print(f"wrote {results_index.write()}")
    elif args.combine:
        publish("capacity", combine_capacity(args.files), False)
    else:
        for name in args.files:
            render(name)

"""Equal fidelity for capacity rows: each JustFit row's page-format mix, measured by
the quality suite (teacher-forced top-1 and KL against float16 pages, within the
trained context) with the same page shares, and whether headline ratios may use it.

A row's mix (e.g. q8c 10%, k8cv4 20%, q4c 40%, q3c 30%) is what the pressure ladder
leaves when the pages are held to a byte limit; the quality suite's `FMT@SHARE` holds
pages in FMT to SHARE of FMT's bytes and lets the same ladder step them down, so the
share that reproduces the mix is the mix's bytes over FMT's.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEADLINE_TOP1 = 0.99  # rows under this top-1 stay in the tables, out of the headline


def mix_spec(kv_formats: dict[str, float], fmt: str, head_dim: int, paged_share: float = 1.0) -> str:
    """The quality suite's spec for a row's mix: `fmt` alone, or `fmt@SHARE`. The suite
    holds pages to SHARE of what all its tokens would take in `fmt`, but only
    `paged_share` of them become pages (sinks and the hot window stay full precision)."""
    from kvexec import get_format
    from kvexec.formats import needs_model

    if needs_model(fmt):  # per-layer formats calibrated for the model: the suite calibrates the same
        return fmt  # (a mix the ladder stepped down shows as measured on another mix)
    if not kv_formats or set(kv_formats) <= {fmt}:
        return fmt
    size = {f: get_format(f).bytes_per_token(1, head_dim) for f in {*kv_formats, fmt}}
    total = sum(kv_formats.values())
    share = sum(n * size[f] for f, n in kv_formats.items()) / (total * size[fmt])
    return f"{fmt}@{share * paged_share:.3f}"


def mix_distance(a: dict[str, float], b: dict[str, float]) -> float:
    """Total variation distance between two page-format mixes (shares or counts)."""
    ta, tb = sum(a.values()) or 1, sum(b.values()) or 1
    return 0.5 * sum(abs(a.get(k, 0) / ta - b.get(k, 0) / tb) for k in {*a, *b})


MIX_TOLERANCE = 0.1  # a measured mix further than this from the row's is another mix


def measure(model: str, specs: list[str], tokens: int, timeout: float = 6 * 3600) -> dict[str, dict]:
    """Quality rows by spec, from one `bench.quality` run against float16 pages; an
    error row per spec if it failed."""
    cmd = [sys.executable, "-m", "bench.quality", "--model", model, "--formats", ",".join(specs),
           "--tokens", str(tokens), "--reference", "fp16", "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        return {r["format"]: r for r in result["systems"]}
    except (subprocess.SubprocessError, ValueError, IndexError, KeyError) as e:
        return {s: {"error": f"quality run failed: {e}"} for s in specs}


def attach(rows: list[dict], model: str, tokens: int) -> None:
    """Give every JustFit row with positions its `fidelity` (top-1, KL, perplexity
    change against float16 pages for its mix), measured `tokens` deep; 0 tokens:
    marked unmeasured."""
    from kvexec import KVConfig

    kv = KVConfig()
    paged = max(0.1, 1 - (kv.sink_tokens + kv.hot_window + kv.page_size / 2) / max(tokens, 1))
    wanted = {}
    for r in rows:
        if r["system"].startswith("justfit") and r.get("kv_format") and "positions" in r:
            wanted[id(r)] = mix_spec(r.get("kv_formats") or {}, r["kv_format"], r["head_dim"], paged)
    measured = measure(model, sorted(set(wanted.values())), tokens) if tokens and wanted else {}
    for r in rows:
        if id(r) not in wanted:
            continue
        spec = wanted[id(r)]
        got = measured.get(spec)
        if got is None:
            r["fidelity"] = {"spec": spec, "error": "not measured (--fidelity-tokens 0)"}
        elif "error" in got:
            r["fidelity"] = {"spec": spec, "error": got["error"]}
        else:
            r["fidelity"] = {"spec": spec, "top1": round(got["top1"], 4), "kl": got["kl"],
                             "ppl_delta": round(got["ppl_delta"], 4), "tokens": got["tokens"],
                             "reference": "fp16 pages", "measured_mix": got.get("kv_formats")}
            if got.get("kv_formats") and r.get("kv_formats"):
                r["fidelity"]["mix_distance"] = round(mix_distance(got["kv_formats"], r["kv_formats"]), 3)


def headline_exclusion(row: dict) -> str:
    """Why `row` may not stand in a headline ratio, or "" when it may: a JustFit row
    needs a measured top-1 >= 99% for its format mix and must keep every position."""
    if "positions" not in row and "modeled_positions" not in row:
        return "no capacity"
    if not row["system"].startswith("justfit"):
        return ""
    if row["system"] == "justfit-retention":
        return "evicts positions"
    if "@" in row["system"]:  # a layer pipeline: the budget is each rank's, not the whole
        return f"budget per rank ({row['system'].partition('@')[2]} processes)"
    fidelity = row.get("fidelity") or {}
    top1 = fidelity.get("top1")
    if top1 is None:
        return "fidelity not measured"
    if fidelity.get("mix_distance", 0) > MIX_TOLERANCE:
        return f"fidelity measured on another mix ({fidelity['measured_mix']})"
    return "" if top1 >= HEADLINE_TOP1 else f"top-1 {top1:.2%} < {HEADLINE_TOP1:.0%}"


def mark(row: dict) -> None:
    """Set a row's `past_trained_context` and `headline` (eligible, or why not)."""
    trained = row.get("trained_context")
    held = row.get("positions", row.get("modeled_positions"))
    if trained and held is not None:
        row["past_trained_context"] = held > trained
    why = headline_exclusion(row)
    row["headline"] = why or "eligible"

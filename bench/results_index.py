"""bench/results/INDEX.md: every result file kept, with its suite, date, commit,
parameters and a one-line summary, all read from the files themselves
(`python -m bench.report` writes it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.summary import RESULTS

NAME = re.compile(r"^(?P<suite>[a-z]+(?:-[a-z0-9]*[a-z][a-z0-9]*)*)-(?P<date>\d{8})"
                  r"(?:-(?P<time>\d{6}))?(?P<tag>-[\w-]+)?$")
MOST = 6  # rows summarized per file before "and N more"


def _when(date: str, time: str | None) -> str:
    day = f"{date[:4]}-{date[4:6]}-{date[6:]}"
    return f"{day} {time[:2]}:{time[2:4]}" if time else day


def _some(parts: list[str]) -> str:
    more = len(parts) - MOST
    return "; ".join(parts[:MOST]) + (f"; and {more} more" if more > 0 else "")


def _capacity(r: dict) -> str:
    def one(s: dict) -> str:
        if "error" in s:
            return f"{s['system']} {s.get('budget_mib', 0):g} MiB: error"
        n = f"{s['positions']:,}" if s.get("positions") is not None else "none"
        if s.get("modeled_positions") is not None:
            n += f" measured, {s['modeled_positions']:,} modeled"
        return f"{s['system']} {s.get('budget_mib', 0):g} MiB: {n} ({s.get('ended_by', '')})"
    return _some([one(s) for s in r["systems"]])


def _speed(r: dict) -> str:
    return _some([f"{s['system']} {s.get('context')}: " + ("error" if "error" in s else
                  f"prefill {s['prefill_tps']:.1f}, decode {s['decode_tps']:.1f} tok/s") for s in r["systems"]])


def _quality(r: dict) -> str:
    def one(s: dict) -> str:
        name = s.get("format") or s.get("system")
        if "top1" in s:
            return f"{name}: top-1 {s['top1']:.2%} over {s.get('tokens', '?')} tokens"
        if "passkey_hits" in s:
            return f"{name}: pass keys {s['passkey_hits']}/{s['passkey_trials']} at {s.get('context')}"
        return f"{name}: {'error' if 'error' in s else '-'}"
    return _some([one(s) for s in r["systems"] if s.get("format") != "reference" or "passkey_hits" in s])


def _batch(r: dict) -> str:
    def one(s: dict) -> str:
        if "ratio_median" in s:
            return f"{s['streams']} streams: batched / alone {s['ratio_median']}"
        if "short_ttft_s" in s:
            return f"--max-batch {s['max_batch']}: short request's first token {s['short_ttft_s']} s"
        return f"{s.get('mode')}: wall {s.get('wall_s')} s"
    return _some([one(s) for s in r["systems"]])


def _rows(r: dict) -> str:
    keys = ("speedup", "restart_speedup", "ttft_from_snapshot_s", "ttft_restart_s", "ttft_cold_s", "ratio",
            "aggregate", "decode_tps", "kv_mib")
    rows = r.get("systems") or r.get("rows") or []
    return _some([", ".join(f"{k} {_short(s[k])}" for k in ("system", "context", *keys) if k in s) for s in rows])


def _serve(r: dict) -> str:
    parts = []
    for what, got in r.get("results", {}).items():
        if what == "load":
            parts.append(f"load: {got.get('completed')}/{got.get('total')} completed, p99 {got['latency_s']['p99']} s")
        elif what == "ttft":
            parts.append(f"ttft: turn 2 {_short(got['ttft_turn2_s'])} s against {_short(got['ttft_turn1_s'])} s")
        elif what == "fuzz":
            parts.append(f"fuzz: {got.get('cases', '')} cases, 5xx {got.get('5xx', got.get('status_5xx', '?'))}")
        else:
            parts.append(what)
    return _some(parts)


def _calibration(r: dict) -> str:
    chosen = (r.get("chosen") or {}).get("0.001") or {}
    text = f"gain {r['gain']:.4g} over {r.get('tokens')} tokens"
    if not chosen:
        return text
    bits = f"{chosen['bits_per_value']:.3f} bits a value"
    full = chosen.get("bits_per_value_full_layers")
    if full is not None and abs(full - chosen["bits_per_value"]) > 1e-6:
        bits += f" ({full:.3f} in the full layers)"
    return f"{text}; at a KL budget of 1e-3: {chosen['summary']}, {bits}"


def _codecs(r: dict) -> str:
    def at(savings: dict, width: str) -> str:
        return ", ".join(f"{family.rstrip('-')} {got[width]:+.2f}" for family, got in savings.items() if width in got)
    return (f"bits a value saved against the default's codecs, keys at a5: {at(r['key_savings'], 'a5')}; "
            f"values at vr64-5: {at(r['value_savings'], 'vr64-5')}")


def _short(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _generic(r: dict) -> str:
    if "sessions_lost_or_corrupt" in r:
        return f"sessions lost or corrupt: {r['sessions_lost_or_corrupt']}"
    return "fields: " + ", ".join(k for k in r if k != "machine")


def _overhead(r: dict) -> str:
    return _some([f"{x.get('system', x['path'])} @ {x['context']}: JustFit host / mlx-lm {x['host_over_mlx_lm']}, "
                  f"ops/token {x['ops_justfit']:g} vs {x['ops_mlx_lm']:g}" for x in r.get("host_ratios", [])])


def _footprint(r: dict) -> str:
    return _some([f"{s['system']}{' (' + s['tree'] + ')' if s.get('tree') else ''} {s['model']} {s['context']:,}: "
                  + ("error" if "error" in s else f"peak {s['peak_rss'] / 2**20:.0f} MiB") for s in r["rows"]])


def _grammar_libraries(r: dict) -> str:
    return _some([f"{s['library']} {s['model']}: " + ("error" if "error" in s else
                   f"mask median {s['mask_us_median']:g} µs, compile {s['compile_ms_median']:g} ms, "
                   f"tokenizer {s['tokenizer_rss_bytes'] / 2**20:.1f} MiB") for s in r["rows"]])


def _structured(r: dict) -> str:
    return _some([f"{s['model']}: " + ("error" if "error" in s else
                   f"constrained {s['constrained_slowdown']:+.1%} against free, forced tokens {s['forced_speedup']:g}x")
                   for s in r["systems"]])


def _schema_suite(r: dict) -> str:
    return _some([f"{r['passed']}/{r['sent']} replies valid"] +
                 [f"{k}: {c['passed']}/{c['sent']}" for k, c in r["combos"].items()])


SUMMARIES = {"capacity": _capacity, "grammar-libraries": _grammar_libraries, "structured": _structured,
             "schema-suite": _schema_suite, "footprint": _footprint, "overhead": _overhead, "speed": _speed, "quality": _quality, "batch": _batch, "kv-decode": _rows,
             "state": _rows, "state-restart": _rows, "sessions": _rows, "serve": _serve,
             "kv-calibration-smollm2": _calibration, "kv-calibration-gemma3": _calibration,
             "codecs-smollm2": _codecs, "codecs-gemma3": _codecs}


def _parameters(r: dict) -> str:
    s = r.get("settings") or {}
    if isinstance(s, dict) and s:
        keep = {k: v for k, v in s.items() if k not in ("sources", "machines", "budgets", "json")
                and not isinstance(v, (dict, list))}
        return ", ".join(f"{k} {v}" for k, v in keep.items())
    if "command" in r:
        return f"`{r['command']}`"
    if "model" in r and "tokens" in r:
        return f"model {r['model']}, tokens {r['tokens']}"
    rows = r.get("systems") if isinstance(r.get("systems"), list) else []
    seen = {k: sorted({str(s[k]) for s in rows if k in s}) for k in ("context", "tokens", "format")}
    return ", ".join(f"{k} {', '.join(v)}" for k, v in seen.items() if v)


def entry(stem: str, files: list[Path]) -> dict:
    """What INDEX.md says of one result (its .json and the views beside it)."""
    m = NAME.match(stem)
    suite = m["suite"] if m else stem
    out = {"stem": stem, "suite": suite, "date": _when(m["date"], m["time"]) if m else "",
           "files": ", ".join(sorted(p.suffix.lstrip(".") for p in files)), "commit": "", "parameters": "",
           "summary": ""}
    data = next((p for p in files if p.suffix == ".json"), None)
    if data is None:
        out["summary"] = "a picture" if all(p.suffix == ".png" for p in files) else ""
        return out
    try:
        r = json.loads(data.read_text())
    except (OSError, ValueError) as e:
        out["summary"] = f"unreadable: {e}"
        return out
    machine = r.get("machine") or {}
    out["commit"] = machine.get("commit", "") if isinstance(machine, dict) else ""
    out["parameters"] = _parameters(r)
    summarize = SUMMARIES.get(suite, _generic)
    try:
        out["summary"] = summarize(r)
    except (KeyError, TypeError, ValueError):
        out["summary"] = _generic(r)
    return out


def entries(results: Path = RESULTS) -> list[dict]:
    """One entry per result (files grouped by name), by suite, oldest first."""
    groups: dict[str, list[Path]] = {}
    for p in sorted(results.iterdir()):
        if p.is_file() and p.name != "INDEX.md" and not p.name.startswith("."):
            groups.setdefault(p.name.split(".")[0], []).append(p)
    items = [entry(stem, files) for stem, files in groups.items()]
    return sorted(items, key=lambda e: (e["suite"], e["date"]))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(results: Path = RESULTS) -> str:
    """INDEX.md's text."""
    items = entries(results)
    lines = ["# Result files", "",
             "Written by `python -m bench.report` from the files themselves; the docs say what each "
             "measures (docs/BENCHMARKS.md). Every file here is cited by a doc.", "",
             "| result | suite | date | commit | files | parameters | summary |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {e['stem']} | {e['suite']} | {e['date']} | {e['commit']} | {e['files']} | "
              f"{_cell(e['parameters'])} | {_cell(e['summary'])} |" for e in items]
    return "\n".join(lines) + "\n"


def write(results: Path = RESULTS) -> Path:
    """Write INDEX.md into `results`; its path."""
    path = results / "INDEX.md"
    path.write_text(markdown(results))
    return path

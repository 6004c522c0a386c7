"""The results table the README and docs/BENCHMARKS.md show: one row per measured
comparison, every figure read from the result files the row cites (never typed in),
each row with the command that reruns it. `python -m bench.report` writes it between
the docs' `results-table` markers.

A row names its files; which runs stand for today's figures is chosen here, by name.
A comparison no result file supports is said in words ("not measured here"), never
modeled. Where a newer run of the same kind should replace a row, change its file
names below and rerun `python -m bench.report`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # the repository's own, whatever JUSTFIT_BENCH_RESULTS says
DOCS = (ROOT / "README.md", ROOT / "docs" / "BENCHMARKS.md")
BEGIN = ("<!-- results-table:begin: written by `python -m bench.report` from the result files "
         "each row cites; change bench/summary.py, not this table -->")
END = "<!-- results-table:end -->"
HEADER = ("| measured | JustFit | compared with | result files | rerun |", "|---|---|---|---|---|")

# SmolLM2, whole-process budgets (MiB): the runs measured to the budget on today's pages,
# every weight resident; llama.cpp from the run beside JustFit's where there was one.
CAPACITY = {400: "capacity-20261205-001302", 550: "capacity-20261204-234405", 800: "capacity-20261205-020651"}
LLAMA_Q8_0 = {400: "capacity-20261202-082145", 550: "capacity-20261204-234405", 800: "capacity-20261202-082145"}
LLAMA_F16 = {400: "capacity-20261204-213946", 550: "capacity-20261204-213946"}
FIDELITY = {"SmolLM2": "quality-20261204-231322", "Gemma 3": "quality-20261205-000138"}
SPEED = "speed-20261204-235541"  # SmolLM2, llama.cpp in the same run
SPEED_GEMMA = ("speed-20261204-190058", "speed-20261204-190706")  # two runs minutes apart
BATCH = "batch-20261204-021948"
JUSTFIT_ROW = "justfit-calibrated+resident"  # the CLI's default pages, every weight resident
LLAMA_SYSTEM = re.compile(r"^llama\.cpp")


@dataclass(frozen=True)
class Row:
    """One line of the table: what was measured, JustFit's figures, the baseline's, the
    result files they come from (stems) and the command that reruns them."""

    what: str
    justfit: str
    baseline: str
    sources: tuple[str, ...]
    command: str

    def markdown(self) -> str:
        """The row as a markdown table line."""
        files = ", ".join(f"`{s}`" for s in self.sources)
        command = f"`{self.command}`" if self.command else ""
        return f"| {self.what} | {self.justfit} | {self.baseline} | {files} | {command} |"


def load(stem: str, results: Path = RESULTS) -> dict:
    """The result saved as `results/STEM.json`."""
    return json.loads((results / f"{stem}.json").read_text())


def _find(result: dict, system: str, **where) -> dict:
    for row in result["systems"]:
        if row.get("system") == system and all(row.get(k) == v for k, v in where.items()):
            return row
    raise LookupError(f"no {system} row with {where} in this result")


def _positions(row: dict) -> str:
    """A capacity row's positions; a run that did not reach its budget holds at least them."""
    if row.get("modeled_positions") is not None:
        raise ValueError(f"{row['system']}: a modeled row has no place in the results table")
    n = row["min_positions"] if row.get("min_positions") is not None else row["positions"]
    return (">= " if row.get("limited") else "") + f"{n:,}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _sci(x: float) -> str:
    mantissa, exponent = f"{abs(x) if x == 0 else x:.1e}".split("e")  # a KL of -0.0 (rounding) reads as 0
    return f"{mantissa}e{int(exponent)}"


def capacity_rows(results: Path = RESULTS) -> list[Row]:
    """SmolLM2's positions at whole-process budgets against llama.cpp's q8_0 and f16 KV,
    and the row that says why mlx-lm's float16 KV is not in the table."""
    def got(files: dict[int, str], system: str) -> dict[int, dict]:
        return {b: _find(load(f, results), system, budget_mib=float(b)) for b, f in files.items()}

    jf, q8, f16 = got(CAPACITY, JUSTFIT_ROW), got(LLAMA_Q8_0, "llama.cpp-q8_0"), got(LLAMA_F16, "llama.cpp")
    command = ("python -m bench.capacity --model smollm2 --step 1024 --out 32 --systems "
               "justfit-calibrated+resident,{llama} --llama-cpp DIR --budgets {budgets} --repeats 1 "
               "--max-seconds 4800 --max-positions 98304 --fidelity-tokens 0")

    def row(base: dict[int, dict], files: dict[int, str], name: str, llama: str) -> Row:
        budgets = sorted(base)
        return Row(f"capacity, SmolLM2, positions held within {' / '.join(map(str, budgets))} MiB (whole process)",
                   " / ".join(_positions(jf[b]) for b in budgets) + " (default pages, every weight resident)",
                   f"{name}: " + " / ".join(_positions(base[b]) for b in budgets) + " (JustFit "
                   + " / ".join(_ratio(jf[b]["positions"], base[b]["positions"]) for b in budgets) + ")",
                   tuple(dict.fromkeys([*(CAPACITY[b] for b in budgets), *(files[b] for b in budgets)])),
                   command.format(llama=llama, budgets=",".join(f"{b}MiB" for b in budgets)))

    return [row(q8, LLAMA_Q8_0, "llama.cpp, q8_0 KV (lossy), n_ctx reserved", "llama.cpp-q8_0"),
            row(f16, LLAMA_F16, "llama.cpp, f16 KV (its default), n_ctx reserved", "llama.cpp"),
            Row("capacity against mlx-lm with float16 KV (as its users run it)", "",
                "not measured here (needs Metal)", (), "")]


def newest_llama_fidelity(results: Path = RESULTS) -> str | None:
    """The newest quality result holding llama.cpp rows with a measured top-1, if any."""
    for path in sorted(results.glob("quality-*.json"), key=lambda p: p.stem.split("-", 1)[1], reverse=True):
        try:
            rows = json.loads(path.read_text()).get("systems", [])
        except (OSError, ValueError):
            continue
        if any(LLAMA_SYSTEM.match(str(r.get("system", ""))) and "top1" in r for r in rows):
            return path.stem
    return None


def fidelity_rows(results: Path = RESULTS) -> list[Row]:
    """JustFit's default pages against its float16 KV, and llama.cpp's caches against
    its own f16 KV where a result file holds them (else a row saying they are pending)."""
    cells = []
    for model, stem in FIDELITY.items():
        r = _find(load(stem, results), "justfit-calibrated")
        cells.append(f"{model}: top-1 {r['top1']:.2%}, KL {_sci(r['kl'])} over {r['tokens']:,} tokens")
    rows = [Row("fidelity of the default pages (teacher-forced on `bench.common.long_text()`)", "; ".join(cells),
                "JustFit's own float16 KV (the reference)", tuple(FIDELITY.values()),
                "python -m bench.quality --model smollm2 --tokens 4096 --formats calibrated --reference fp16")]
    stem = newest_llama_fidelity(results)
    if stem is None:
        rows.append(Row("fidelity of llama.cpp's KV caches against its own f16 KV, SmolLM2", "",
                        "pending: no result file holds it yet", (), ""))
        return rows
    result = load(stem, results)
    measured = [r for r in result["systems"] if LLAMA_SYSTEM.match(str(r.get("system", ""))) and "top1" in r]
    text = "; ".join(f"{r['system']}: top-1 {r['top1']:.1%}"
                     + (f", KL {_sci(r['kl'])}" if r.get("kl") is not None else "")
                     + (f" over {r['tokens']:,} tokens" if isinstance(r.get("tokens"), int) else "") for r in measured)
    rows.append(Row("fidelity of llama.cpp's KV caches against its own f16 KV, SmolLM2", "", text, (stem,),
                    result.get("command") or "python -m bench.quality --model smollm2 --llama-cpp DIR"))
    return rows


def speed_rows(results: Path = RESULTS) -> list[Row]:
    """Prefill and decode against llama.cpp (its f16-KV default) in the same run."""
    smol = load(SPEED, results)
    contexts = (1024, 4096)
    jf = [_find(smol, "justfit-default", context=c) for c in contexts]
    ll = [_find(smol, "llama.cpp", context=c) for c in contexts]
    command = ("python -m bench.speed --model {model} --contexts 1024,4096 --decode 32 --systems justfit-default "
               "--repeat 3 --llama-cpp DIR")

    def pair(rows: list[dict], key: str) -> str:
        return " / ".join(f"{r[key]:.1f}" for r in rows)

    def ratios(key: str, a: list[dict], b: list[dict]) -> str:
        return " / ".join(_ratio(x[key], y[key]) for x, y in zip(a, b))

    prompts = " / ".join(f"{c:,}" for c in contexts)
    out = [Row(f"{what}, SmolLM2, tok/s {where} a {prompts}-token prompt", pair(jf, key),
               f"llama.cpp, f16 KV, same run: {pair(ll, key)} (JustFit {ratios(key, jf, ll)})", (SPEED,),
               command.format(model="smollm2"))
           for what, where, key in (("prefill", "over", "prefill_tps"), ("decode", "after", "decode_tps"))]
    runs = [load(stem, results) for stem in SPEED_GEMMA]
    jf_g = [[_find(r, "justfit-default", context=c) for c in contexts] for r in runs]
    ll_g = [[_find(r, "llama.cpp", context=c) for c in contexts] for r in runs]
    each = "two" if len(runs) == 2 else str(len(runs))
    justfit = " and ".join(pair(j, "decode_tps") for j in jf_g)
    llama = " and ".join(pair(ll, "decode_tps") for ll in ll_g)
    ratio = " and ".join(ratios("decode_tps", j, ll) for j, ll in zip(jf_g, ll_g))
    out.append(Row(f"decode, Gemma 3 270M, tok/s after a {prompts}-token prompt, in each of {each} runs "
                   "minutes apart", justfit, f"llama.cpp, f16 KV, same runs: {llama} (JustFit {ratio})",
                   SPEED_GEMMA, command.format(model="gemma3")))
    return out


def batching_rows(results: Path = RESULTS) -> list[Row]:
    """Batched decode's aggregate rate over the same sequences one at a time."""
    result = load(BATCH, results)
    rows = [r for r in result["systems"] if r["streams"] > 1]
    same = all(r["greedy_identical"] for r in rows)
    s = result["settings"]
    return [Row(f"batched decode, SmolLM2, {' / '.join(str(r['streams']) for r in rows)} sequences of "
                f"{s['context']:,} positions", " / ".join(f"{r['ratio_median']:.2f}x" for r in rows)
                + " the aggregate tok/s" + ("; greedy tokens identical" if same else ""),
                "the same sequences one at a time", (BATCH,),
                f"python -m bench.batch decode --streams 1,{','.join(str(r['streams']) for r in rows)} "
                f"--context {s['context']} --tokens {s['tokens']} --repeats {s['repeats']}")]


def rows(results: Path = RESULTS) -> list[Row]:
    """Every row of the table, in the order shown."""
    return [*capacity_rows(results), *fidelity_rows(results), *speed_rows(results), *batching_rows(results)]


def block(results: Path = RESULTS) -> str:
    """The table with its markers, as it stands between them in the docs."""
    return "\n".join([BEGIN, *HEADER, *(r.markdown() for r in rows(results)), END])


def splice(text: str, new_block: str) -> str:
    """`text` with what stands between the results-table markers (markers included)
    replaced by `new_block`; ValueError where the markers are missing."""
    start = text.find("<!-- results-table:begin")
    end = text.find(END, start)
    if start < 0 or end < 0:
        raise ValueError("no <!-- results-table:begin ... --> / <!-- results-table:end --> markers")
    return text[:start] + new_block + text[end + len(END):]


def write(docs=DOCS, results: Path = RESULTS) -> list[Path]:
    """Rewrite the table in every doc that has its markers; the docs that changed."""
    new_block, changed = block(results), []
    for doc in map(Path, docs):
        text = doc.read_text()
        if "<!-- results-table:begin" not in text:
            continue
        updated = splice(text, new_block)
        if updated != text:
            doc.write_text(updated)
            changed.append(doc)
    return changed

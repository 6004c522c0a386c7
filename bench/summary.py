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
# llama.cpp at 400 and 800 MiB: f16, q8_0 and q4_0 KV in one run on this machine; 550 MiB
# from the earlier runs (q8_0 beside JustFit's)
LLAMA_HERE = "capacity-20261207-192908"
LLAMA_Q8_0 = {400: LLAMA_HERE, 550: "capacity-20261204-234405", 800: LLAMA_HERE}
LLAMA_F16 = {400: LLAMA_HERE, 550: "capacity-20261205-121238", 800: LLAMA_HERE}
LLAMA_Q4_0 = {400: LLAMA_HERE, 800: LLAMA_HERE}
TRAINED_CONTEXT = 8192  # SmolLM2's: positions past it are memory held, not a context it reads well
_QUALITY = ("python -m bench.quality --model {} --tokens 8192 --context {} --formats calibrated,q8c "
            "--reference fp16 --llama-cpp DIR --mlx-lm-kv 8 --mlx-lm-dtype float32-dense")
# Per model: the quality run measuring every system on the same text and positions.
PEER_FIDELITY = {"SmolLM2": ("quality-20261205-101054", _QUALITY.format("smollm2", 8192)),
                 "Gemma 3": ("quality-20261205-105003", _QUALITY.format("gemma3", 2048))}
# The speed rows' sitting (bench/sitting.sh): its manifest names the speed and streams
# runs, every comparison in alternating rounds on one machine in one sitting. None: the
# rows below from earlier single runs, said as such.
SITTING: str | None = "sitting-20261207-233251"  # the speed rows: SmolLM2, llama.cpp in the same sitting
SPEED = "speed-20261204-235541"  # SmolLM2, llama.cpp in the same run
SPEED_GEMMA = ("speed-20261204-190058", "speed-20261204-190706")  # two runs minutes apart
RESUME = "resume-peers-20261205-111320"  # JustFit and llama-server, the same run
# Drafts on and off, llama-server with and without its n-gram drafts, the same run per model
SPECULATION = {"SmolLM2": "speculation-20261205-145143", "Gemma 3": "speculation-20261205-151958"}
STREAMS = "streams-20261205-145311"  # SmolLM2: 4 concurrent streams, justfit serve and llama-server -np 4, the same run
# Same request, same reply: --deterministic per model, and the default engine on SmolLM2
SAME_REPLY = {"SmolLM2": "same-reply-20261205-174353", "Gemma 3": "same-reply-20261205-180224"}
SAME_REPLY_DEFAULT = "same-reply-20261205-180815"
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
    """SmolLM2's positions at whole-process budgets against llama.cpp's f16, q8_0 and q4_0
    KV (each lossy one with its fidelity from the peer fidelity run), and the row that
    says why mlx-lm's float16 KV is not in the table."""
    def got(files: dict[int, str], system: str) -> dict[int, dict]:
        return {b: _find(load(f, results), system, budget_mib=float(b)) for b, f in files.items()}

    jf = got(CAPACITY, JUSTFIT_ROW)
    fidelity_stem = PEER_FIDELITY["SmolLM2"][0]
    fidelity = {r.get("format"): r for r in load(fidelity_stem, results)["systems"]
                if LLAMA_SYSTEM.match(str(r.get("system", ""))) and "top1" in r}
    justfit_command = ("python -m bench.capacity --model smollm2 --step 1024 --out 32 --systems "
                       "justfit-calibrated+resident{llama} --llama-cpp DIR --budgets {budgets} --repeats 1 "
                       "--max-seconds 4800 --max-positions 98304 --fidelity-tokens 0")
    here_command = ("python -m bench.capacity --model smollm2 --step 1024 --out 32 --systems "
                    "llama.cpp,llama.cpp-q8_0,llama.cpp-q4_0 --llama-cpp DIR --budgets 400MiB,800MiB --repeats 1 "
                    "--max-seconds 4800 --max-positions 131072 --fidelity-tokens 0")

    def row(files: dict[int, str], system: str, kv: str) -> Row:
        base = got(files, system)
        budgets = sorted(set(base) & set(jf))  # where both sides were measured
        name = f"llama.cpp, {kv} KV, n_ctx reserved"
        if kv == "f16":
            name = "llama.cpp, f16 KV (its default; at JustFit's fidelity or above), n_ctx reserved"
        elif kv in fidelity:
            name = (f"llama.cpp, {kv} KV ({_same_top1(fidelity[kv])} against its f16 KV, JustFit's default pages "
                    f"{_same_top1(_find(load(fidelity_stem, results), 'justfit-calibrated'))}), n_ctx reserved")
        past = all(jf[b]["positions"] > TRAINED_CONTEXT and base[b]["positions"] > TRAINED_CONTEXT for b in budgets)
        # JustFit's runs had the llama.cpp system beside them where a budget's row is not from this machine's run
        beside = any(files[b] != LLAMA_HERE for b in budgets)
        commands = [justfit_command.format(llama=f",{system}" if beside else "",
                                           budgets=",".join(f"{b}MiB" for b in budgets))]
        if any(files[b] == LLAMA_HERE for b in budgets):
            commands.append(here_command)
        return Row(f"capacity, SmolLM2, positions held within {' / '.join(map(str, budgets))} MiB (whole process)"
                   + (f"; every figure past its trained {TRAINED_CONTEXT:,}-token context: memory held, not a "
                      "context it reads well" if past else ""),
                   " / ".join(_positions(jf[b]) for b in budgets) + " (default pages, every weight resident)",
                   f"{name}: " + " / ".join(_positions(base[b]) for b in budgets) + " (JustFit "
                   + " / ".join(_ratio(jf[b]["positions"], base[b]["positions"]) for b in budgets) + ")",
                   tuple(dict.fromkeys([*(CAPACITY[b] for b in budgets), *(files[b] for b in budgets),
                                        *([fidelity_stem] if kv in fidelity else [])])),
                   "; ".join(commands))

    return [row(LLAMA_F16, "llama.cpp", "f16"), row(LLAMA_Q8_0, "llama.cpp-q8_0", "q8_0"),
            row(LLAMA_Q4_0, "llama.cpp-q4_0", "q4_0"),
            Row("capacity against mlx-lm with float16 KV (as its users run it)", "",
                "not measured here (needs Metal)", (), "")]


def _same_top1(r: dict) -> str:
    return f"top-1 {r['top1']:.2%}, KL {_sci(r['kl'])}"


def fidelity_rows(results: Path = RESULTS) -> list[Row]:
    """Per model, one quality run on the same text and positions for every system:
    JustFit's default pages against its float16 KV, llama.cpp's lossy caches against
    its own f16 KV, mlx-lm's quantized KV against its float32 KV."""
    out = []
    for model, (stem, command) in PEER_FIDELITY.items():
        result = load(stem, results)
        jf = _find(result, "justfit-calibrated")
        peers = [f"llama.cpp {r['format']} KV: {_same_top1(r)}" for r in result["systems"]
                 if LLAMA_SYSTEM.match(str(r.get("system", ""))) and r.get("format") != "f16" and "top1" in r]
        text = "; ".join(peers) + " (each against llama.cpp's f16 KV)"
        for r in result["systems"]:
            if str(r.get("system", "")).startswith("mlx-lm-kv") and "top1" in r:
                layers = re.search(r"in (\d+) of (\d+) layers", str(r.get("kv_cache", "")))
                where = f" in {layers[1]} of {layers[2]} layers (its full-attention ones)" \
                    if layers and layers[1] != layers[2] else ""
                text += (f"; mlx-lm {r['format']} KV{where}: {_same_top1(r)} (against its float32 KV, "
                         "float32 activations)")
        windows = f"{jf['chunks']} window{'s' if jf['chunks'] > 1 else ''} of {jf['context']:,} tokens"
        out.append(Row(f"fidelity, {model}: same text and positions for every system ({windows}, "
                       f"{jf['scored']:,} positions scored)", f"default pages: {_same_top1(jf)} (against its "
                       "float16 KV)", text, (stem,), command))
    return out


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
    keys = (("prefill", "prefill_tps"), ("decode", "decode_tps"))
    out = [Row(f"prefill and decode, SmolLM2, tok/s over / after a {prompts}-token prompt (one run, its repeats "
               "back to back, not alternating rounds: superseded by bench/sitting.sh's rows once they sit)",
               "; ".join(f"{what} {pair(jf, key)}" for what, key in keys),
               "llama.cpp, f16 KV, same run: " + ", ".join(f"{what} {pair(ll, key)}" for what, key in keys)
               + " (JustFit " + "; ".join(ratios(key, jf, ll) for _, key in keys) + ")", (SPEED,),
               command.format(model="smollm2"))]
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


def _spread(x: dict, fmt: str = ".1f") -> str:
    """A median with its range over rounds: '90.4 (88.1-91.0)'."""
    return f"{x['median']:{fmt}} ({x['min']:{fmt}}-{x['max']:{fmt}})"


def _row_spread(row: dict, key: str) -> str:
    return _spread({"median": row[key], "min": row[f"{key}_min"], "max": row[f"{key}_max"]})


def _ratio_spread(q: dict) -> str:
    return f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}x)"


def _ratio_of(result: dict, system: str, over: str, rate: str, **where) -> dict:
    for q in result["ratios"]:
        if (q["system"], q["over"], q["rate"]) == (system, over, rate) and all(q.get(k) == v for k, v in where.items()):
            return q
    raise LookupError(f"no {system} / {over} {rate} ratio with {where} in this result")


def sitting_rows(results: Path = RESULTS) -> list[Row]:
    """The sitting's rows (SITTING): decode and prefill against llama-bench, one stream
    and 4 at once against llama-server, JustFit's drafts off (llama.cpp's work) and, in
    rows of their own, on; every figure the median (min-max) of the sitting's
    alternating rounds, every ratio the median (min-max) of each round's pair."""
    manifest = load(SITTING, results)
    files = manifest["files"]
    speed, depth, streams = (load(files[k], results) for k in ("speed", "speed_depth", "streams"))
    rounds = manifest["settings"]["rounds"]
    commands = {k: re.sub(r"--llama-cpp \S+", "--llama-cpp DIR", v["command"]) for k, v in manifest["steps"].items()}
    held = depth["settings"]["depth"]
    short = speed["settings"]["contexts"]
    ll = "llama.cpp"

    def decode(system: str) -> tuple[str, str]:
        ours = [_find(speed, system, context=c) for c in short] + [_find(depth, system)]
        theirs = [_find(speed, ll, context=c) for c in short] + [_find(depth, ll)]
        qs = [_ratio_of(speed, system, ll, "decode_tps", context=c) for c in short] + \
            [_ratio_of(depth, system, ll, "decode_tps")]
        return (" / ".join(_row_spread(r, "decode_tps") for r in ours),
                "llama-bench, f16 KV, same rounds: " + " / ".join(_row_spread(r, "decode_tps") for r in theirs)
                + " (JustFit " + " / ".join(map(_ratio_spread, qs)) + ")")

    positions = " / ".join(f"{c:,}" for c in [*short, held])
    each = f"median (min-max) of {rounds} alternating rounds, one sitting"
    sources = (SITTING, files["speed"], files["speed_depth"])
    command = f"bench/sitting.sh DIR ({commands['speed']}; {commands['speed_depth']})"
    out = []
    for system, what in (("justfit-nodraft", "drafts off (one token a step, as llama-bench)"),
                         ("justfit-drafts", "n-gram drafts on (JustFit's default; the prompt's own text drafts "
                                            "tokens: not llama-bench's work)")):
        jf, base = decode(system)
        out.append(Row(f"decode, SmolLM2, tok/s after {positions} positions ({held:,}: random keys and values "
                       f"held, llama-bench -d), {what}, {each}", jf, base, sources, command))
    prefill_jf = [_find(speed, "justfit-nodraft", context=short[-1]), _find(depth, "justfit-nodraft")]
    prefill_ll = [_find(speed, ll, context=short[-1]), _find(depth, ll)]
    qs = [_ratio_of(speed, "justfit-nodraft", ll, "prefill_tps", context=short[-1]),
          _ratio_of(depth, "justfit-nodraft", ll, "prefill_tps")]
    after = depth["settings"]["contexts"][0]
    out.append(Row(f"prefill, SmolLM2, tok/s of {short[-1]:,} tokens / {after:,} tokens after {held:,}, {each}",
                   " / ".join(_row_spread(r, "prefill_tps") for r in prefill_jf),
                   "llama-bench, f16 KV, same rounds: " + " / ".join(_row_spread(r, "prefill_tps") for r in prefill_ll)
                   + " (JustFit " + " / ".join(map(_ratio_spread, qs)) + ")", sources, command))
    s = streams["settings"]
    prompt = _find(streams, "justfit-nodraft")["rounds"][0].get("prompt_tokens")
    for system, what in (("justfit-nodraft", '`"speculate": false` (one token a step, as llama-server)'),
                         ("justfit-drafts", '`"speculate": true` (n-gram drafts; greedy text from a small model '
                                            "repeats, which flatters them)")):
        jf = _find(streams, system)
        one, many = _find(streams, "llama-server-np1"), _find(streams, "llama-server-np4")
        q1 = _ratio_of(streams, system, "llama-server-np1", "single_tps")
        q4 = _ratio_of(streams, system, "llama-server-np4", "aggregate_tps")
        out.append(Row(f"greedy streams over HTTP, SmolLM2, {s['max_tokens']} tokens each after a {prompt}-token "
                       "prompt: "
                       f"one stream's decode tok/s / {s['streams']} streams' aggregate tok/s, {each}",
                       f"`justfit serve`, no flags, {what}: {_row_spread(jf, 'single_tps')} / "
                       f"{_row_spread(jf, 'aggregate_tps')}",
                       f"llama-server -np 1 / -np {many.get('slots', 4)}, same rounds: "
                       f"{_row_spread(one, 'single_tps')} / "
                       f"{_row_spread(many, 'aggregate_tps')} (JustFit {_ratio_spread(q1)} / {_ratio_spread(q4)})",
                       (SITTING, files["streams"]), f"bench/sitting.sh DIR ({commands['streams']})"))
    return out


def sitting_speculation_row(results: Path = RESULTS) -> Row:
    """The sitting's drafts on against off in one `justfit serve` (bench.speculation
    --rounds): per workload the decode-rate ratio (the agent's: its total time, off over
    on) as the median (min-max) of the alternating rounds."""
    manifest = load(SITTING, results)
    stem = manifest["files"]["speculation"]
    result = load(stem, results)
    system = result["systems"][0]
    work = system["workloads"]
    command = re.sub(r"--llama-cpp \S+", "--llama-cpp DIR", manifest["steps"]["speculation"]["command"])

    def q(name: str, key: str) -> str:
        w = work[name]
        return _ratio_spread({"median": w[f"{key}_median"], "min": w[f"{key}_min"], "max": w[f"{key}_max"]})

    names = [n for n in ("prose", "chat", "code-edit") if n in work]
    rates = "; ".join(f"{n} {q(n, 'decode')} (drafts accepted {work[n]['acceptance'] or 0:.0%})" for n in names)
    agent = f"; the agent trajectory {q('agent', 'time')} (its time with drafts off over on)" if "agent" in work else ""
    differ = [n for n in work if not work[n].get("identical_to_drafts_off")]
    same = ("replies identical with drafts off in every round" if not differ else
            f"replies identical with drafts off except in some round of: {', '.join(differ)} (the default engine's "
            "numerics: a verified draft's rows are computed as one forward)")
    return Row(f"speculative decoding, SmolLM2 (its chat template), greedy, {result['settings']['max_tokens']} tokens: "
               f"decode rate with n-gram drafts over without, one `justfit serve`, each request alternating, "
               f"median (min-max) of {system['rounds']} rounds, one sitting",
               f"{rates}{agent}; {same}", "drafts off, the same server and rounds",
               (SITTING, stem), f"bench/sitting.sh DIR ({command})")


def resume_rows(results: Path = RESULTS) -> list[Row]:
    """A long conversation's next turn: JustFit's prefix cache and named session against
    llama-server's prompt cache and slot save/restore, the same run."""
    result = load(RESUME, results)
    jf, ll = _find(result, "justfit"), _find(result, "llama-server")
    repeats = result.get("settings", {}).get("repeats", 1)
    each = f"medians of {repeats} rounds" if repeats > 1 else "one round"

    def s(x: float) -> str:
        return f"{x:.2f} s"

    return [Row(f"next turn of a {jf['context']:,}-token SmolLM2 conversation (+{jf['follow_up_tokens']} tokens), "
                f"time to first token, {each} on a shared machine",
                f"prefix cache {s(jf['ttft_warm_s'])}; named session after a restart {s(jf['ttft_restart_s'])} "
                f"(recomputing: {s(jf['ttft_cold_s'])})",
                f"llama-server, f16 KV, same run: cache_prompt {s(ll['ttft_warm_s'])}; slot saved and restored "
                f"across a restart {s(ll['ttft_restart_s'])} (recomputing: {s(ll['ttft_cold_s'])})", (RESUME,),
                f"python -m bench.resume_peers --model smollm2 --context {jf['context']} --llama-cpp DIR"
                + (f" --repeats {repeats}" if repeats > 1 else ""))]


def speculation_rows(results: Path = RESULTS) -> list[Row]:
    """Drafts from the conversation's own text: decode rate on code edits and prose, an
    agent trajectory's total time; against llama-server with and without its n-gram
    drafts, the same run, per model."""
    out = []
    for model, stem in SPECULATION.items():
        result = load(stem, results)
        on, off = _find(result, "justfit"), _find(result, "justfit-nodraft")
        ll, lln = _find(result, "llama-server"), _find(result, "llama-server-ngram")
        w = {name: (on["workloads"][name], off["workloads"][name]) for name in ("code-edit", "prose", "agent")}
        same = [name for name, (a, _) in w.items() if a.get("identical_to_drafts_off")]
        rate = " / ".join(f"{w[n][0]['decode_tps']:.1f} vs {w[n][1]['decode_tps']:.1f} tok/s "
                          f"({_ratio(w[n][0]['decode_tps'], w[n][1]['decode_tps'])})" for n in ("code-edit", "prose"))
        agent_on, agent_off = w["agent"][0]["total_s"], w["agent"][1]["total_s"]
        text = result["settings"].get("text")
        out.append(Row(f"speculative decoding, {model}, greedy{', a base model continuing its own plain text (not chat: its replies echo their prompt)' if text else ''}: "
                       f"decode on code edits / prose, drafts on vs off, and a {len(w['agent'][0]['replies'])}-turn "
                       "agent trajectory's total time; one run, one server per system (not a median of alternating "
                       "rounds)",
                       f"{rate}; agent {agent_on:.1f} s vs {agent_off:.1f} s ({_ratio(agent_on, agent_off)} the time); "
                       f"text identical with drafts off: {', '.join(same) or 'none'}",
                       f"llama-server, same run: agent {ll['workloads']['agent']['total_s']:.1f} s, with its n-gram "
                       f"drafts {lln['workloads']['agent']['total_s']:.1f} s; code edits "
                       f"{ll['workloads']['code-edit']['decode_tps']:.1f} / {lln['workloads']['code-edit']['decode_tps']:.1f} tok/s",
                       (stem,), f"python -m bench.speculation --model {result['settings']['model']} --llama-cpp DIR"))
    return out


def streams_rows(results: Path = RESULTS) -> list[Row]:
    """Concurrent streams through `justfit serve` with no flags against llama-server -np 4."""
    result = load(STREAMS, results)
    jf, ll = _find(result, "justfit"), _find(result, "llama-server-np4")
    s = result["settings"]
    return [Row(f"{s['streams']} concurrent greedy streams over HTTP, SmolLM2, aggregate tok/s (median of {s['rounds']} rounds)",
                f"`justfit serve`, no flags (n-gram drafts on, its default; llama-server's none): "
                f"{jf['aggregate_tps']:.1f} (one stream alone: {jf['single_tps']:.1f})",
                f"llama-server -np 4, same run: {ll['aggregate_tps']:.1f} (JustFit {_ratio(jf['aggregate_tps'], ll['aggregate_tps'])})",
                (STREAMS,), f"python -m bench.streams --model smollm2 --streams {s['streams']} "
                f"--max-tokens {s['max_tokens']} --rounds {s['rounds']} --llama-cpp DIR")]


def _identical(result: dict) -> str:
    """'identical on every path' or the paths where some reply differed, with counts."""
    summary = result["summary"]
    short = {p: v for p, v in summary.items() if v["identical"] < v["compared"]}
    if not short:
        return "identical on every path"
    return "; ".join(f"{p} {v['identical']}/{v['compared']}" for p, v in short.items()) + ", the other paths identical"


def same_reply_rows(results: Path = RESULTS) -> list[Row]:
    """Each prompt's greedy reply cold against every other path, `--deterministic`, per
    model; the default engine (dense prefill) on SmolLM2 beside it."""
    default = load(SAME_REPLY_DEFAULT, results)
    out = []
    for model, stem in SAME_REPLY.items():
        result = load(stem, results)
        s = result["settings"]
        paths = ", ".join(result["summary"])
        out.append(Row(f"same request, same greedy reply, {model}: {s['prompts']} prompts (code, prose, chat turns; "
                       f"up to {s['max_prompt']} tokens, {s['max_tokens']} generated), each cold and then {paths}",
                       f"`--deterministic` ({result['numerics']['mode']}): {_identical(result)}",
                       (f"the default engine, same prompts ({default['settings']['prompts']}): {_identical(default)}"
                        if model == "SmolLM2" else ""),
                       (stem, SAME_REPLY_DEFAULT) if model == "SmolLM2" else (stem,),
                       f"python -m bench.same_reply --model {s['model']} --prompts {s['prompts']}"
                       + ("; the same with --numerics fast --prompts 20" if model == "SmolLM2" else "")))
    return out


def rows(results: Path = RESULTS) -> list[Row]:
    """Every row of the table, in the order shown."""
    speculation = speculation_rows(results)
    if SITTING:
        speed = [*sitting_rows(results), *speed_rows(results)[1:]]  # Gemma 3's decode rows stay until it sits too
        streams = []
        speculation = [sitting_speculation_row(results), *speculation[1:]]  # SmolLM2's sat; Gemma 3's stays
    else:
        speed, streams = speed_rows(results), streams_rows(results)
    return [*capacity_rows(results), *fidelity_rows(results), *speed, *resume_rows(results),
            *streams, *speculation, *same_reply_rows(results)]


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

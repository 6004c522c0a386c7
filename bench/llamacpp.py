"""llama.cpp on the same GGUF: its speed through `llama-bench`, and its capacity
(whole-process peak RSS at a stepped context): as its users run it, float16 KV with flash
attention as it decides, and the KV cache in q8_0 or q4_0 via -ctk/-ctv, flash attention
on. Binaries come from `--llama-cpp DIR` (e.g. built from the llama.cpp tree vendored in
the llama-cpp-python sdist); a missing binary gives an error row, never a dropped one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

# llama.cpp as its users run it (float16 KV, flash attention as it decides), then the
# quantized KV it needs to hold long contexts (flash attention on): speed and capacity rows.
CACHE_TYPES = {"llama.cpp": "f16", "llama.cpp-q8_0": "q8_0", "llama.cpp-q4_0": "q4_0"}


def binary(llama_cpp: str, name: str = "llama-bench") -> str:
    """`name` in the folder `llama_cpp` (or beside it, when it names a binary)."""
    path = Path(llama_cpp).expanduser()
    return str(path.parent / name if path.is_file() else path / name)


def _gguf(model: str) -> str:
    from justfit.model.models import EMBEDDED

    return str(EMBEDDED[model]()) if model in EMBEDDED else model


def _bench_cmd(exe: str, gguf: str, prompt: int, decode: int, cache_type: str, repeat: int = 1,
               depth: int = 0) -> list[str]:
    flash = "auto" if cache_type == "f16" else "1"  # a quantized V cache needs flash attention
    return [exe, "-m", gguf, "-p", str(prompt), "-n", str(decode), "-r", str(repeat), "-fa", flash,
            "-ctk", cache_type, "-ctv", cache_type, "-t", str(os.cpu_count() or 1), "-d", str(depth), "-o", "json"]


def _rates(exe: str, gguf: str, cache_type: str, repeat: int, prompt: int, decode: int, depth: int) -> dict:
    """llama-bench's mean tokens per second for each test of one run, {(n_prompt, n_gen): rate}:
    with a depth, its prompt and generation tests share one (untimed) fill of it."""
    out = subprocess.run(_bench_cmd(exe, gguf, prompt, decode, cache_type, repeat, depth),
                         capture_output=True, text=True, timeout=3600, check=True).stdout
    return {(t.get("n_prompt"), t.get("n_gen")): t["avg_ts"] for t in json.loads(out)}


def _rate(exe: str, gguf: str, cache_type: str, repeat: int, prompt: int, decode: int, depth: int) -> float:
    """llama-bench's mean tokens per second for one test (prompt processing or generation)."""
    return _rates(exe, gguf, cache_type, repeat, prompt, decode, depth)[prompt, decode]


def llama_run(llama_cpp: str, system: str, model: str, context: int, decode: int, repeat: int = 1,
              depth: int = 0, prefill: bool = True) -> dict:
    """One measurement of `system` (a CACHE_TYPES name), as bench.speed's workers report
    theirs: without a depth, prompt processing of `context` tokens from none and
    generation of `decode` tokens after `context` held (llama-bench's -d: the same
    context as JustFit's decode); with one, both after `depth` positions held, filled
    once, untimed (`context` prompt tokens then, `decode` generated after `depth`).
    `prefill` False: generation only. An "error" key where llama-bench failed."""
    exe, gguf, kv = binary(llama_cpp), _gguf(model), CACHE_TYPES[system]
    row = {"kv_dtype": kv, "flash_attention": "auto" if kv == "f16" else True,
           "decode_depth": depth or context, **({"prefill_depth": depth} if depth else {})}
    try:
        if depth:  # one fill serves both tests (llama-bench keeps the state of a depth it computed)
            rates = _rates(exe, gguf, kv, repeat, context if prefill else 0, decode, depth)
            pp, tg = rates.get((context, 0)) if prefill else None, rates[0, decode]
        else:
            pp = _rate(exe, gguf, kv, repeat, context, 0, 0) if prefill else None
            tg = _rate(exe, gguf, kv, repeat, 0, decode, context)
        row.update(prefill_tps=pp, decode_tps=tg, ttft_s=context / pp if pp else None,
                   read_bytes=read_bytes(model, gguf, (depth or context) + decode, kv))
        if prefill and pp is None:
            raise KeyError(f"no pp{context} test in llama-bench's output")
    except (OSError, subprocess.SubprocessError, ValueError, StopIteration, KeyError) as e:
        row = {**row, "error": f"llama-bench failed: {e}"}
    return row


def llama_bench(llama_cpp: str, model: str, contexts: list[int], decode: int, repeat: int,
                systems: tuple[str, ...] = tuple(CACHE_TYPES)) -> list[dict]:
    """One row per system and context (`llama_run` with `repeat` repetitions in one
    llama-bench), or an error row."""
    rows = []
    for system in systems:
        for context in contexts:
            run = llama_run(llama_cpp, system, model, context, decode, repeat)
            rows.append({"system": system, "model": model, "context": context, "decode_tokens": decode, **run})
    return rows


_BYTES_PER_VALUE = {"q8_0": 34 / 32, "q4_0": 18 / 32, "f16": 2.0}


def read_bytes(model: str, gguf: str, context: int, cache_type: str) -> int:
    """Bytes one llama.cpp decode step at `context` reads: the GGUF's tensors (a tied
    embedding is the head) and the KV cache it attends over (sliding-window layers:
    their window), from the model's config."""
    from justfit.planning.fit_config import layer_kinds
    from justfit.model.models import resolve

    config = json.loads((Path(resolve(model)) / "config.json").read_text())
    kv_dim = config.get("num_key_value_heads", config["num_attention_heads"]) * config.get(
        "head_dim", config["hidden_size"] // config["num_attention_heads"])
    window = config.get("sliding_window") or context
    seen = sum(min(context, window) if kind == "sliding" else context
               for kind in layer_kinds(config, config["num_hidden_layers"]))
    return Path(gguf).stat().st_size + int(2 * kv_dim * seen * _BYTES_PER_VALUE[cache_type])


# Runs argv[1:] as its child, its output to /dev/null, and prints the child's peak RSS
# (KiB) and exit status. Linux counts into a child's peak the peak of the process it was
# forked from (the copied address space's high-water mark survives exec), so a child of
# this harness, which may have held far more (a 512 MiB bandwidth probe, a tokenizer),
# would report the harness's peak; a child of this small launcher reports its own.
_LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def peak_rss(cmd: list[str], timeout: float) -> tuple[int, int, str]:
    """Run `cmd`; (its own peak RSS in bytes from the kernel's accounting of that one
    process, exit status, last stderr line). On timeout: (0, -9, "timed out ...")."""
    import signal
    import sys
    import tempfile

    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, *cmd], stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)  # its own group: a timeout stops both
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 0, -9, f"timed out after {timeout:.0f} s"
        err.seek(0)
        tail = (err.read().decode(errors="replace").strip().splitlines() or [""])[-1]
    fields = out.split()
    if proc.returncode != 0 or len(fields) != 2:
        return 0, proc.returncode or -1, tail
    return int(fields[0]) * 1024, int(fields[1]), tail


def _completion_cmd(exe: str, gguf: str, n_ctx: int, cache_type: str) -> list[str]:
    flash = "auto" if cache_type == "f16" else "on"  # a quantized V cache needs flash attention
    return [exe, "-m", gguf, "-c", str(n_ctx), "-n", "4", "-p", "Hello", "-no-cnv", "-fa", flash, "-fit", "off",
            "-ctk", cache_type, "-ctv", cache_type, "-t", str(os.cpu_count() or 1), "--temp", "0"]


def _buffer_mib(log: str, what: str) -> float:
    """The sum of llama.cpp's logged `what` buffer sizes (e.g. "KV", "compute"), MiB."""
    return sum(float(m) for m in re.findall(rf"{what} buffer size = +([0-9.]+) MiB", log))


def reserve_step(llama_cpp: str, system: str, model: str, n_ctx: int, timeout: float) -> dict:
    """One `llama-completion` with an `n_ctx` context and a short prompt: its whole-process
    peak RSS holds the KV cache for all of n_ctx (llama.cpp clears the buffer when it
    makes it) but only the part of the compute buffer a short prompt touches; the row's
    peak adds the compute buffer's reserved size, what a last 512-token ubatch at n_ctx
    fills (checked against full passes: bench.llamacpp.capacity_steps)."""
    import tempfile

    exe = binary(llama_cpp, "llama-completion")
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        start = time.perf_counter()
        rss, code, tail = peak_rss(_completion_cmd(exe, _gguf(model), n_ctx, CACHE_TYPES[system]) +
                                   ["--log-file", log.name], timeout)
        text = Path(log.name).read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"llama-completion exit {code}: {tail}")
    kv, compute = _buffer_mib(text, "KV"), _buffer_mib(text, "compute")
    return {"positions": n_ctx, "peak_rss": int(rss + compute * 2**20), "reserved_rss": rss,
            "kv_buffer_mib": kv, "compute_buffer_mib": compute,
            "kv_bytes_per_position": round(kv * 2**20 / n_ctx, 1), "step_s": round(time.perf_counter() - start, 2),
            "kv_dtype": CACHE_TYPES[system], "prefill_step": 512, "weights_dtype": "GGUF as stored",
            "flash_attention": True, "method": "n_ctx reserved + compute buffer"}


def reserve_edge(llama_cpp: str, system: str, model: str, budget: int, limit: int, grain: int = 256,
                 timeout: float = 600) -> tuple[list[dict], str]:
    """The largest n_ctx (a multiple of `grain`, at most `limit`) whose reserve_step
    peak stays within `budget`: a line through two probes, then steps of `grain` across
    the edge. Returns every probe (ascending) and why it ended."""
    exe = binary(llama_cpp, "llama-completion") if llama_cpp else ""
    if not exe or not Path(exe).is_file():
        return [], f"error: no llama-completion{' at ' + exe if exe else ''}: pass --llama-cpp DIR"
    probes: dict[int, dict] = {}

    def probe(n: int) -> dict:
        if n not in probes:
            probes[n] = reserve_step(llama_cpp, system, model, n, timeout)
        return probes[n]

    try:
        a, b = probe(grain * 4), probe(min(limit, grain * 64))
        slope = max(1.0, (b["peak_rss"] - a["peak_rss"]) / (b["positions"] - a["positions"]))
        n = max(grain, min(limit, int((a["positions"] + (budget - a["peak_rss"]) / slope) // grain * grain)))
        while n > grain and probe(n)["peak_rss"] > budget:
            n -= grain
        while n + grain <= limit and probe(n + grain)["peak_rss"] <= budget:
            n += grain
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return sorted(probes.values(), key=lambda s: s["positions"]), f"error: {e}"
    steps = sorted(probes.values(), key=lambda s: s["positions"])
    return steps, "budget" if any(s["peak_rss"] > budget for s in steps) else "position limit"


def capacity_steps(llama_cpp: str, system: str, model: str, positions: list[int], out: int,
                   budget: int, timeout: float) -> tuple[list[dict], str]:
    """One fresh `llama-bench` per context in `positions` (prompt = context - out, then
    `out` generated; n_ctx is their sum), until one passes `budget`. Returns the steps
    (positions, peak_rss, step_s) and why it ended."""
    exe = binary(llama_cpp) if llama_cpp else ""
    if not exe or not Path(exe).is_file():
        return [], f"error: no llama-bench{' at ' + exe if exe else ''}: pass --llama-cpp DIR (llama.cpp's binaries)"
    steps = []
    for n in positions:
        start = time.perf_counter()
        # -pg: one test that prefills n - out tokens and then generates `out` in one context of n
        cmd = _bench_cmd(exe, _gguf(model), 0, 0, CACHE_TYPES[system]) + ["-pg", f"{n - out},{out}"]
        rss, code, tail = peak_rss(cmd, timeout)
        if code != 0:
            return steps, f"error: llama-bench exit {code}: {tail}"
        steps.append({"positions": n, "peak_rss": rss, "step_s": round(time.perf_counter() - start, 2),
                      "kv_dtype": CACHE_TYPES[system], "prefill_step": 512, "weights_dtype": "GGUF as stored",
                      "flash_attention": True})
        if rss > budget:
            return steps, "budget"
    return steps, "position limit"


def validate(llama_cpp: str, system: str, model: str, contexts: list[int], out: int, timeout: float) -> list[dict]:
    """reserve_step's peak against a full pass's (llama-bench, the context filled) at
    each of `contexts`: the reserved-memory method's error, where it can be measured."""
    full, end = capacity_steps(llama_cpp, system, model, contexts, out, 2**62, timeout)
    rows = []
    for f in full:
        r = reserve_step(llama_cpp, system, model, f["positions"], timeout)
        rows.append({"positions": f["positions"], "full_pass_peak_mib": round(f["peak_rss"] / 2**20, 1),
                     "reserved_peak_mib": round(r["peak_rss"] / 2**20, 1),
                     "error_mib": round((r["peak_rss"] - f["peak_rss"]) / 2**20, 1), "full_pass_s": f["step_s"]})
    if end.startswith("error"):
        rows.append({"error": end[len("error: "):]})
    return rows

"""Whole-process footprint: one request, as a new user runs each server, against llama-server.

    python -m bench.footprint --model smollm2 --contexts 8000 --llama-cpp DIR
    python -m bench.footprint --model gemma3 --contexts 7184,22004 --llama-cpp DIR
    python -m bench.footprint --model smollm2 --contexts 8000 --justfit-tree /tmp/before   # another checkout
    python -m bench.footprint --model gemma3 --contexts 1024 --systems justfit --first-load
    python -m bench.footprint --model gemma3 --contexts 1024 --systems justfit --first-load --budget 500MiB

Protocol: per model and prompt length, each system is a fresh server process on a free
port given one request of `context` deterministic prompt tokens (bench.common.prompt_tokens,
the same token ids to both), greedy, `--tokens` generated; then the kernel's high-water
mark of that one process (VmHWM: the whole-process peak RSS) and its RSS are read from
/proc before it is stopped. JustFit runs `justfit serve` with its defaults (no budget);
its row also carries `/v1/justfit/status`'s measured breakdown after the request, where
the checkout has one. llama-server runs with flash attention, `--threads` threads and
its context reserved at the model's trained length, f16 KV (its default) and q8_0.
With `--first-load` JustFit starts from an empty model cache (its own JUSTFIT_CACHE), so
its load converts the GGUF and measures the KV calibration as a new user's first run
does: the row's `loaded` peak is that load's, shown beside the request's peak. With
`--budget` JustFit runs under that whole-process budget (`--budget SIZE --whole-process`);
a first load predicted above it is refused before any work, and the row keeps the
refusal (`refused`) with the prediction the server logged (`first_load`).
Memory figures are robust on a shared machine; the timings beside them are not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import machine_info, prompt_tokens
from bench.report import publish
from bench.llamacpp import binary
from bench.server_process import free_port

LLAMA_KV = {"llama-server": "f16", "llama-server-q8_0": "q8_0"}
SYSTEMS = ("justfit", *LLAMA_KV)


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exit {proc.returncode}: {log.read_text(errors='replace')[-800:]}")
        try:
            if _get(url + "/health", 2).get("status") in ("ok", "degraded"):
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


def _proc_memory(pid: int) -> dict:
    """The process's own peak (VmHWM) and current RSS, and its anonymous and file-backed shares, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return {"peak_rss": fields["VmHWM"], "rss": fields["VmRSS"], "rss_anon": fields.get("RssAnon"),
            "rss_file": fields.get("RssFile")}


def _serve_cmd(system: str, args, gguf: str, port: int, trained: int) -> list[str]:
    if system == "justfit":
        budget = ["--budget", args.budget, "--whole-process"] if args.budget else []
        return [str(Path(sys.executable).parent / "justfit"), "serve", "--port", str(port), "--model", args.model,
                *budget]
    kv = LLAMA_KV[system]
    return [binary(args.llama_cpp or "", "llama-server"), "-m", gguf, "--port", str(port), "-c", str(trained),
            "-fa", "on", "-t", str(args.threads), "-ctk", kv, "-ctv", kv]


def run_one(system: str, args, ids: list[int], gguf: str, trained: int) -> dict:
    """One fresh server of `system`, one request of `ids`, its memory read before it stops."""
    row = {"system": system, "model": Path(args.model).name, "context": len(ids), "generated": args.tokens,
           "kv": "JustFit's default pages" if system == "justfit" else LLAMA_KV[system]}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = _serve_cmd(system, args, gguf, port, trained)
    env = dict(os.environ)
    tmp = Path(tempfile.mkdtemp(prefix="justfit-footprint-"))
    env["JUSTFIT_STATE_DIR"] = str(tmp / "state")  # nothing warm from earlier runs
    if system == "justfit" and args.first_load:
        env["JUSTFIT_CACHE"] = str(tmp / "cache")  # no converted weights, no calibration
        row["first_load"] = True
    if system == "justfit" and args.justfit_tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.justfit_tree, env.get("PYTHONPATH")]))
        row["tree"] = args.justfit_tree
    log, proc = tmp / "server.log", None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _wait_ready(url, proc, log, args.timeout)
        row["loaded"] = _proc_memory(proc.pid)
        start = time.perf_counter()
        if system == "justfit":
            reply = _post(url + "/v1/completions", {"prompt": ids, "max_tokens": args.tokens, "temperature": 0,
                                                    "ignore_eos": True}, args.timeout)
            row["text"] = reply["choices"][0]["text"]
        else:
            reply = _post(url + "/completion", {"prompt": ids, "n_predict": args.tokens, "temperature": 0,
                                                "top_k": 1, "cache_prompt": False, "ignore_eos": True}, args.timeout)
            row["text"] = reply.get("content")
        row["request_s"] = round(time.perf_counter() - start, 2)
        row.update(_proc_memory(proc.pid))
        if system == "justfit":
            status = _get(url + "/v1/justfit/status")
            row["breakdown"] = status.get("memory", {}).get("breakdown")
            row["mlx_peak"] = status.get("memory", {}).get("mlx_peak")
    except (OSError, RuntimeError, ValueError, KeyError, urllib.error.URLError) as e:
        row["error"] = str(e)[-400:]
    finally:
        if system == "justfit" and args.budget:
            row["budget"] = args.budget
            row.update(_first_load_lines(log))
        if row.get("first_load"):  # what the load left in the model cache (none where it was refused)
            row["cache_files"] = sum(1 for p in (tmp / "cache").rglob("*") if p.is_file())
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def _first_load_lines(log: Path) -> dict:
    """The first-load prediction the server logged, or its refusal (see justfit.model.first_load)."""
    found = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if "first load of" in line:
            key = "refused" if "does not fit the memory budget" in line else "first_load_predicted"
            found[key] = line[line.index("first load of"):]
    return found


def table(rows: list[dict]) -> str:
    """The markdown table: whole-process peak RSS per model and prompt, a column per system."""
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    lines = ["| model, prompt | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for model, context in dict.fromkeys((r["model"], r["context"]) for r in rows):
        cells = []
        for s in systems:
            r = next((r for r in rows if (r["model"], r["context"], r["system"]) == (model, context, s)), None)
            cells.append("-" if r is None else f"error: {r['error'][:60]}" if "error" in r
                         else f"{r['peak_rss'] / 2**20:.0f} MiB" + (f" (first load {r['loaded']['peak_rss'] / 2**20:.0f})"
                                                                   if r.get("first_load") else ""))
        lines.append(f"| {model}, {context:,} tokens | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench.footprint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="8000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated, greedy")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR", help="folder with llama.cpp's llama-server")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    ap.add_argument("--justfit-tree", default=None, metavar="DIR",
                    help="run JustFit's server from this source tree (PYTHONPATH), e.g. an older checkout")
    ap.add_argument("--first-load", action="store_true",
                    help="JustFit from an empty model cache: its load converts and calibrates (see above)")
    ap.add_argument("--budget", default=None, metavar="SIZE",
                    help="JustFit under this whole-process budget (--budget SIZE --whole-process)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per server start or request")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    args = ap.parse_args(argv)
    from justfit.model.models import EMBEDDED, resolve
    from justfit.model.tokenizer import GGUFTokenizer

    folder = Path(resolve(args.model))
    trained = json.loads((folder / "config.json").read_text()).get("max_position_embeddings") or 8192
    gguf = str(EMBEDDED[args.model]()) if args.model in EMBEDDED else args.model
    tokenizer = GGUFTokenizer(folder)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids = prompt_tokens(tokenizer, context)
        for system in args.systems.split(","):
            rows.append(run_one(system, args, ids, gguf, trained))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "breakdown"}), file=sys.stderr)
    result = {"suite": "footprint", "machine": machine_info(), "argv": sys.argv[1:] if argv is None else argv,
              "trained_context": trained, "rows": rows, "table": table(rows)}
    publish("footprint", result, args.json)
    if not args.json:
        print(result["table"])


if __name__ == "__main__":
    main()

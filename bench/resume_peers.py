"""Resuming a long conversation, JustFit against llama-server's own prompt caches: time
to first token of the second turn, the same token prompts sent to both servers over
their OpenAI-compatible /v1/completions.

    python -m bench.resume_peers --model smollm2 --context 4096 --llama-cpp ~/llama.cpp/build/bin

Turn 1 is `context` tokens of text (bench.common.prompt_tokens); turn 2 is turn 1 plus
a short follow-up. Every TTFT is the wall time of a non-streamed one-token request
(prefill plus one sampled token), each server measured the same way:

- cold: a fresh server, turn 2 with nothing cached;
- warm: turn 1, then turn 2 on the same server (llama-server: `cache_prompt`, its
  default; JustFit: its prefix cache);
- restart: turn 1, the server stopped and started again, then turn 2 (llama-server:
  its slot saved with `--slot-save-path` before the stop and restored after the start,
  restore time counted in the TTFT and shown apart; JustFit: a named session, written
  through to its state folder and restored by the request itself).

What each server says it reused (llama-server's `timings.cache_n`, JustFit's
`usage.prompt_tokens_details.cached_tokens`) goes in the row, so a cache miss shows.
With `--repeats N` the systems take turns, N rounds, and each time is the median of
its rounds (every round's value kept beside it); each round records the machine's
1-minute load average before and after, since other work on a shared machine moves
these times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FOLLOW = " Now summarize the above in one sentence."
SESSION = "bench-resume"
SLOT_FILE = "bench-resume.bin"


def prompts(model: str, context: int) -> tuple[list[int], list[int]]:
    """(turn 1, turn 2) token prompts, by the model's GGUF tokenizer (llama.cpp's own
    tokenization of the same text: bench.peer_fidelity checks they agree)."""
    from bench.common import prompt_tokens
    from justfit.model.models import load

    tok = load(model, lazy=True).tokenizer
    history = prompt_tokens(tok, context)
    return history, history + list(tok.encode(FOLLOW, add_special_tokens=False))


def _body(tokens: list[int], session: str | None = None) -> dict:
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": False, "cache_prompt": True}
    if session:
        body["session"] = session  # JustFit's named session; llama-server ignores the field
    return body


def reused(reply: dict) -> int | None:
    """Prompt tokens a server says it did not recompute (None where it does not say)."""
    timings = reply.get("timings") or {}
    if "cache_n" in timings:
        return int(timings["cache_n"])
    details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details["cached_tokens"]) if "cached_tokens" in details else None


async def _post(session, url: str, body: dict, timeout: float) -> tuple[float, dict]:
    import aiohttp

    start = time.perf_counter()
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        reply = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {json.dumps(reply)[:300]}")
    return time.perf_counter() - start, reply


class Server:
    """One server process on a free port (JustFit's `justfit serve`, or llama-server),
    started by `start()`, ready once /health answers, stopped by `stop()` (SIGINT:
    each one's clean shutdown). Its state (JustFit's state folder, llama-server's slot
    files) lives under `state`, which outlives a restart."""

    def __init__(self, system: str, model: str, state: Path, context: int, llama_cpp: str = ""):
        self.system, self.model, self.state, self.context, self.llama_cpp = system, model, state, context, llama_cpp
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def command(self, port: int) -> tuple[list[str], dict]:
        if self.system == "justfit":
            exe = str(Path(sys.executable).parent / "justfit")
            return [exe, "serve", "--port", str(port), "--model", self.model], \
                {**os.environ, "JUSTFIT_STATE_DIR": str(self.state)}
        from bench.llamacpp import _gguf, binary

        slots = self.state / "slots"
        slots.mkdir(parents=True, exist_ok=True)
        return [binary(self.llama_cpp, "llama-server"), "-m", _gguf(self.model), "--port", str(port),
                "--host", "127.0.0.1", "-c", str(self.context + 256), "-np", "1", "-t", str(os.cpu_count() or 1),
                "--slot-save-path", str(slots) + os.sep], dict(os.environ)

    async def start(self) -> float:
        """Start and wait until healthy; seconds that took."""
        from bench.server_process import free_port, wait_healthy

        port = free_port()
        cmd, env = self.command(port)
        self.url = f"http://127.0.0.1:{port}"
        log = self.state / f"{self.system}.log"
        self.state.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        await wait_healthy(self.url, self.proc, log, timeout=600)
        return time.perf_counter() - start

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.asynccontextmanager
async def _client():
    import aiohttp

    async with aiohttp.ClientSession() as s:
        yield s


async def measure(system: str, model: str, context: int, llama_cpp: str = "", timeout: float = 3600) -> dict:
    """One row: cold, warm and restart TTFTs of the second turn for `system`
    ("justfit" or "llama-server")."""
    turn1, turn2 = prompts(model, context)
    row = {"system": system, "model": model, "context": len(turn1), "follow_up_tokens": len(turn2) - len(turn1)}
    if system == "llama-server":
        from bench.llamacpp import binary

        exe = binary(llama_cpp, "llama-server") if llama_cpp else ""
        if not exe or not Path(exe).is_file():
            return {**row, "error": f"no llama-server{' at ' + exe if exe else ''}: pass --llama-cpp DIR"}
        row.update(kv_dtype="f16", prompt_cache="cache_prompt (default on); slot save/restore across the restart")
    else:
        row.update(prompt_cache="prefix cache; named session written through, restored after the restart")
    row["load_before"] = round(os.getloadavg()[0], 2)
    scratch = Path(tempfile.mkdtemp(prefix="justfit-resume-peers-"))
    session = SESSION if system == "justfit" else None
    path = "/v1/completions"
    try:
        async with _client() as http:
            cold = Server(system, model, scratch / "cold", context, llama_cpp)
            await cold.start()
            try:
                row["ttft_cold_s"], reply = await _post(http, cold.url + path, _body(turn2), timeout)
                row["cold_reused_tokens"] = reused(reply)
            finally:
                cold.stop()

            warm = Server(system, model, scratch / "warm", context, llama_cpp)
            row["start_s"] = await warm.start()
            try:
                row["turn1_s"], _ = await _post(http, warm.url + path, _body(turn1), timeout)
                row["ttft_warm_s"], reply = await _post(http, warm.url + path, _body(turn2), timeout)
                row["warm_reused_tokens"] = reused(reply)
            finally:
                warm.stop()

            server = Server(system, model, scratch / "restart", context, llama_cpp)
            await server.start()
            try:
                await _post(http, server.url + path, _body(turn1, session), timeout)
                if system == "llama-server":
                    row["slot_save_s"], saved = await _post(http, server.url + "/slots/0?action=save",
                                                            {"filename": SLOT_FILE}, timeout)
                    row["slot_saved_tokens"], row["slot_file_bytes"] = saved.get("n_saved"), saved.get("n_written")
            finally:
                server.stop()
            row["restart_start_s"] = await server.start()
            try:
                restore = 0.0
                if system == "llama-server":
                    restore, restored = await _post(http, server.url + "/slots/0?action=restore",
                                                    {"filename": SLOT_FILE}, timeout)
                    row["slot_restore_s"], row["slot_restored_tokens"] = restore, restored.get("n_restored")
                ttft, reply = await _post(http, server.url + path, _body(turn2, session), timeout)
                row["ttft_restart_s"] = restore + ttft
                row["restart_reused_tokens"] = reused(reply)
            finally:
                server.stop()
    except (OSError, RuntimeError, asyncio.TimeoutError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        row["load_after"] = round(os.getloadavg()[0], 2)
    for kind in ("warm", "restart"):
        row[f"{kind}_speedup"] = row["ttft_cold_s"] / row[f"ttft_{kind}_s"]
    return row


TIMES = ("ttft_cold_s", "ttft_warm_s", "ttft_restart_s", "turn1_s", "start_s", "restart_start_s",
         "slot_save_s", "slot_restore_s")


def combine(rounds: list[dict]) -> dict:
    """One system's rounds as one row: each time the median of its rounds (the rounds'
    values in `KEY_rounds`), the speedups from the medians; a failed round makes the row
    an error row, the rounds kept."""
    if len(rounds) == 1:
        return rounds[0]
    row = {**rounds[0], "repeats": len(rounds)}
    failed = [r["error"] for r in rounds if "error" in r]
    for key in (*TIMES, "load_before", "load_after"):
        values = [r[key] for r in rounds if key in r]
        if values:
            row[f"{key}_rounds"] = values
            row[key] = statistics.median(values)
    if failed:
        return {**row, "error": failed[0]}
    for kind in ("warm", "restart"):
        row[f"{kind}_speedup"] = row["ttft_cold_s"] / row[f"ttft_{kind}_s"]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=4096, help="tokens of the first turn")
    ap.add_argument("--systems", default="justfit,llama-server")
    ap.add_argument("--llama-cpp", default="", help="llama.cpp's binaries (llama-server)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds, the systems taking turns; times are medians")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    args = ap.parse_args(argv)
    from bench.common import machine_info
    from bench.report import publish

    systems = args.systems.split(",")
    unknown = set(systems) - {"justfit", "llama-server"}
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}: choose justfit, llama-server")
    if args.repeats < 1:
        ap.error("--repeats takes 1 or more")
    rounds: dict[str, list[dict]] = {system: [] for system in systems}
    for _ in range(args.repeats):
        for system in systems:  # one at a time: neither server shares the CPU with the other
            rounds[system].append(asyncio.run(measure(system, args.model, args.context, args.llama_cpp)))
            print(json.dumps(rounds[system][-1]), file=sys.stderr, flush=True)
    rows = [combine(rounds[system]) for system in systems]
    settings = {"model": args.model, "context": args.context, "repeats": args.repeats, "cores": os.cpu_count()}
    result = {"machine": machine_info(), "settings": settings, "systems": rows}
    publish("resume-peers", result, args.json)


if __name__ == "__main__":
    main()

"""Concurrent greedy streams over HTTP: `justfit serve` with no flags (batching on, its
automatic limit) and with `--max-batch 1`, against llama-server with `-np 4` (4 slots)
and `-np 1`, on the same GGUF, the same prompts, one server at a time.

    python -m bench.streams --model smollm2 --streams 4 --max-tokens 128 --rounds 2
    python -m bench.streams ... --justfit-tree /tmp/before   # adds justfit-before: another checkout's serve, no flags

Each round: one stream alone, then `--streams` at once (distinct prompts, each
`--max-tokens` tokens, end-of-sequence ignored so every stream decodes the same count).
A row per system: tokens per second of the lone stream (its decode rate, tokens after
the first over the time after the first arrived) and the aggregate of the concurrent
streams (all their tokens over the wall time from the first request to the last
reply), the median over rounds, with the load average around it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.speculation import LLAMA_CPP, chat, running

TOPICS = ["the history of the printing press", "how a bicycle gear works", "why the sky is blue",
          "the life of honey bees", "how bread rises", "the rules of chess", "how tides work",
          "the first flight across the Atlantic"]


@dataclass
class Server:
    """One server of the comparison: its name and how to start it on a port."""

    name: str
    model: str
    llama_cpp: str = LLAMA_CPP
    context: int = 8192

    def command(self, port: int) -> list[str]:
        if self.name == "justfit-before":  # the checkout on PYTHONPATH (--justfit-tree), as its users ran it
            return [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--model", self.model]
        if self.name.startswith("justfit"):
            cmd = [str(Path(sys.executable).parent / "justfit"), "serve", "--port", str(port), "--model", self.model]
            return cmd + (["--max-batch", "1"] if self.name == "justfit-max-batch-1" else [])
        from bench.llamacpp import _gguf, binary

        slots = self.name.rsplit("-np", 1)[1]
        return [binary(self.llama_cpp, "llama-server"), "-m", _gguf(self.model), "--port", str(port),
                "--host", "127.0.0.1", "-c", str(self.context), "-np", slots, "-t", str(os.cpu_count() or 1)]


SERVERS = ("justfit", "justfit-max-batch-1", "justfit-before", "llama-server-np4", "llama-server-np1")


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a long essay about {TOPICS[i % len(TOPICS)]}."}]


async def _round(http, url: str, streams: int, max_tokens: int, timeout: float) -> dict:
    alone = await _chat(http, url, messages(0), max_tokens, timeout)
    start = time.perf_counter()
    many = await asyncio.gather(*(_chat(http, url, messages(i + 1), max_tokens, timeout) for i in range(streams)))
    wall = time.perf_counter() - start
    tokens = sum(r.completion_tokens or 0 for r in many)
    after_first = (alone.completion_tokens or 0) - 1
    return {"single_tps": round(after_first / alone.decode_s, 2) if alone.decode_s > 0 else None,
            "aggregate_tps": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 2),
            "errors": [r.error for r in [alone, *many] if r.error]}


async def _chat(http, url, msgs, max_tokens, timeout):
    return await chat(http, url, msgs, max_tokens, None, timeout, extra={"ignore_eos": True})


async def measure(server: Server, args) -> dict:
    import aiohttp

    row = {"system": server.name, "load_before": round(os.getloadavg()[0], 2), "rounds": []}
    async with running(server) as url, aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        await _chat(http, url, messages(0), 8, args.timeout)  # warm: the first request's one-off costs
        for _ in range(args.rounds):
            row["rounds"].append(await _round(http, url, args.streams, args.max_tokens, args.timeout))
            print(json.dumps({"system": server.name, **row["rounds"][-1]}), file=sys.stderr, flush=True)
    for key in ("single_tps", "aggregate_tps"):
        values = [r[key] for r in row["rounds"] if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    if row["single_tps"] and row["aggregate_tps"]:
        row["aggregate_over_single"] = round(row["aggregate_tps"] / row["single_tps"], 3)
    row["load_after"] = round(os.getloadavg()[0], 2)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a GGUF path (the same file for all)")
    ap.add_argument("--systems", default=",".join(SERVERS))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-cpp", default=LLAMA_CPP)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--justfit-tree", default=None, metavar="DIR", help="a checkout to run as justfit-before")
    args = ap.parse_args(argv)
    names = [n for n in args.systems.split(",") if n != "justfit-before" or args.justfit_tree]
    if set(names) - set(SERVERS):
        ap.error(f"unknown systems {sorted(set(names) - set(SERVERS))}: choose from {', '.join(SERVERS)}")
    from bench.common import machine_info, save

    rows = []
    for name in names:
        env = dict(os.environ)
        if name == "justfit-before":
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [args.justfit_tree, env.get("PYTHONPATH")]))
        try:
            rows.append(asyncio.run(measure(Server(name, args.model, args.llama_cpp), args)))
        finally:
            os.environ.clear()
            os.environ.update(env)
        if name == "justfit-before":
            rows[-1]["tree"] = args.justfit_tree
    by = {r["system"]: r for r in rows}
    ratios = {}
    if by.get("justfit", {}).get("aggregate_tps") and by.get("llama-server-np4", {}).get("aggregate_tps"):
        ratios["justfit_over_llama_np4"] = round(by["justfit"]["aggregate_tps"] / by["llama-server-np4"]["aggregate_tps"], 3)
    for other in ("justfit-max-batch-1", "justfit-before"):
        if by.get("justfit", {}).get("single_tps") and by.get(other, {}).get("single_tps"):
            ratios[f"single_justfit_over_{other.replace('-', '_')}"] = round(by["justfit"]["single_tps"]
                                                                            / by[other]["single_tps"], 3)
        if by.get("justfit", {}).get("aggregate_tps") and by.get(other, {}).get("aggregate_tps"):
            ratios[f"aggregate_justfit_over_{other.replace('-', '_')}"] = round(by["justfit"]["aggregate_tps"]
                                                                               / by[other]["aggregate_tps"], 3)
    settings = {k: getattr(args, k) for k in ("model", "streams", "max_tokens", "rounds")}
    path = save("streams", {"machine": machine_info(), "settings": settings, "systems": rows, "ratios": ratios})
    print(json.dumps(ratios), file=sys.stderr)
    print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

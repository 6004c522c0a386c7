"""Concurrent greedy streams over HTTP: `justfit serve` with no flags (batching on, its
automatic limit) and with `--max-batch 1`, against llama-server with `-np 4` (4 slots)
and `-np 1`, on the same GGUF, the same prompts.

    python -m bench.streams --model smollm2 --systems justfit-nodraft,justfit-drafts,llama-server-np1,llama-server-np4 \
        --streams 4 --max-tokens 96 --rounds 3 --llama-cpp DIR
    python -m bench.streams ... --justfit-tree /tmp/before   # adds justfit-before: another checkout's serve, no flags

Systems: `justfit-nodraft` is `justfit serve` with no flags, each request carrying
`"speculate": false` (one token a step: llama-server's work, the rows set against it);
`justfit-drafts` the same server, `"speculate": true` (n-gram drafts from the text so
far, the server's default); `justfit` the same server, the field left out (its default:
drafts on); `justfit-max-batch-1` `--max-batch 1`; `justfit-before` another checkout;
`llama-server-np1` / `-np4` llama-server with 1 or 4 slots, no drafts. The rows whose
command is the same share one server process.

Every server is started first, then `--rounds` alternating rounds: each round measures
every system once (the order turned a step each round) before the next. Each
measurement: one stream alone, then `--streams` at once (distinct ~20-token prompts,
each `--max-tokens` tokens, end-of-sequence ignored so every stream decodes the same
count; greedy text from a small model repeats, which flatters drafts: read the drafts-on
rows with their `accepted` counts). A row per system: tokens per second of the lone
stream (its decode rate, tokens after the first over the time after the first arrived)
and the aggregate of the concurrent streams (all their tokens over the wall time from
the first request to the last reply), the median over rounds with its range (min-max);
`ratios`: each JustFit row over each llama-server row, per round, then their median and
range. The load average is recorded around it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    tree: str | None = None  # justfit-before's checkout, put first on the server's PYTHONPATH

    @property
    def process(self) -> str:
        """The server process this row's requests go to: rows with one command share it."""
        return "justfit" if self.name in SAME_SERVER else self.name

    @property
    def speculate(self) -> bool | None:
        """The request's `speculate` field (None: left out, the server's default)."""
        return {"justfit-nodraft": False, "justfit-drafts": True}.get(self.name)

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


SERVERS = ("justfit-nodraft", "justfit-drafts", "justfit", "justfit-max-batch-1", "justfit-before", "llama-server-np4",
           "llama-server-np1")
DEFAULT = ("justfit-nodraft", "justfit-drafts", "llama-server-np1", "llama-server-np4")
SAME_SERVER = ("justfit-nodraft", "justfit-drafts", "justfit")  # `justfit serve`, no flags


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a long essay about {TOPICS[i % len(TOPICS)]}."}]


async def _round(http, url: str, server: Server, streams: int, max_tokens: int, timeout: float) -> dict:
    alone = await _chat(http, url, server, messages(0), max_tokens, timeout)
    start = time.perf_counter()
    many = await asyncio.gather(*(_chat(http, url, server, messages(i + 1), max_tokens, timeout)
                                  for i in range(streams)))
    wall = time.perf_counter() - start
    tokens = sum(r.completion_tokens or 0 for r in many)
    after_first = (alone.completion_tokens or 0) - 1
    out = {"single_tps": round(after_first / alone.decode_s, 2) if alone.decode_s > 0 else None,
           "aggregate_tps": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 2),
           "single_tokens": alone.completion_tokens, "prompt_tokens": alone.prompt_tokens,
           "errors": [r.error for r in [alone, *many] if r.error]}
    if any(r.drafted is not None for r in [alone, *many]):  # what the drafts did: acceptance
        out["drafted"] = [r.drafted for r in [alone, *many]]
        out["accepted"] = [r.accepted for r in [alone, *many]]
    return out


async def _chat(http, url, server: Server, msgs, max_tokens, timeout):
    return await chat(http, url, msgs, max_tokens, server.speculate, timeout, extra={"ignore_eos": True})


@contextlib.contextmanager
def _pythonpath(tree: str | None):
    """PYTHONPATH with `tree` first while in the block (None: unchanged)."""
    before = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, before]))
    try:
        yield
    finally:
        if tree:
            os.environ.pop("PYTHONPATH", None) if before is None else os.environ.__setitem__("PYTHONPATH", before)


def spread(values: list[float]) -> dict:
    """Median and range (min-max) over rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


async def measure_all(servers: list[Server], args) -> list[dict]:
    """Start every server process (rows sharing a command share one), then alternate:
    each round measures every row once before the next round begins."""
    import aiohttp

    rows = {s.name: {"system": s.name, "rounds": [], **({"speculate": s.speculate} if s.process == "justfit" else {}),
                     **({"slots": int(s.name.rsplit("-np", 1)[1])} if s.name.startswith("llama-server") else {})}
            for s in servers}
    load_before = round(os.getloadavg()[0], 2)
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)))
        urls = {}
        for s in servers:
            if s.process not in urls:
                with _pythonpath(s.tree):  # read as the server process starts
                    urls[s.process] = await stack.enter_async_context(running(s))
        for s in servers:  # warm: each row's first request's one-off costs
            await _chat(http, urls[s.process], s, messages(0), 8, args.timeout)
        for rnd in range(args.rounds):
            k = rnd % len(servers)
            for s in servers[k:] + servers[:k]:
                got = await _round(http, urls[s.process], s, args.streams, args.max_tokens, args.timeout)
                rows[s.name]["rounds"].append(got)
                print(json.dumps({"system": s.name, "round": rnd + 1, **got}), file=sys.stderr, flush=True)
    for row in rows.values():
        row["load_before"] = load_before
        row["load_after"] = round(os.getloadavg()[0], 2)
        for key in ("single_tps", "aggregate_tps"):
            values = [r[key] for r in row["rounds"] if r[key] is not None]
            if values:
                got = spread(values)
                row[key], row[f"{key}_min"], row[f"{key}_max"] = got["median"], got["min"], got["max"]
            else:
                row[key] = None
        if row["single_tps"] and row["aggregate_tps"]:
            row["aggregate_over_single"] = round(row["aggregate_tps"] / row["single_tps"], 3)
    return list(rows.values())


def ratios(rows: list[dict]) -> list[dict]:
    """Each JustFit row over each llama-server row and each other JustFit row, per rate:
    the ratio of one round's two measurements, its median and range over the rounds."""
    out = []
    ours = [r for r in rows if r["system"].startswith("justfit")]
    for a in ours:
        for b in rows:
            if b is a or (b["system"].startswith("justfit") and a["system"] not in SAME_SERVER):
                continue
            for key in ("single_tps", "aggregate_tps"):
                pairs = [(x[key], y[key]) for x, y in zip(a["rounds"], b["rounds"]) if x.get(key) and y.get(key)]
                if pairs:
                    out.append({"system": a["system"], "over": b["system"], "rate": key,
                                **spread([x / y for x, y in pairs]), "each": [round(x / y, 4) for x, y in pairs]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a GGUF path (the same file for all)")
    ap.add_argument("--systems", default=",".join(DEFAULT), help=f"any of {', '.join(SERVERS)}")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-cpp", default=LLAMA_CPP)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--justfit-tree", default=None, metavar="DIR", help="a checkout to run as justfit-before")
    args = ap.parse_args(argv)
    names = [n for n in args.systems.split(",") if n != "justfit-before" or args.justfit_tree]
    if set(names) - set(SERVERS):
        ap.error(f"unknown systems {sorted(set(names) - set(SERVERS))}: choose from {', '.join(SERVERS)}")
    from bench.common import machine_info, save

    servers = [Server(n, args.model, args.llama_cpp, tree=args.justfit_tree if n == "justfit-before" else None)
               for n in names]
    rows = asyncio.run(measure_all(servers, args))
    for row in rows:
        if row["system"] == "justfit-before":
            row["tree"] = args.justfit_tree
    ratios_ = ratios(rows)
    settings = {k: getattr(args, k) for k in ("model", "streams", "max_tokens", "rounds")}
    path = save("streams", {"machine": machine_info(), "settings": settings, "systems": rows, "ratios": ratios_})
    for q in ratios_:
        print(f"{q['system']} / {q['over']}, {q['rate']}: {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}, "
              f"{q['n']} rounds)", file=sys.stderr)
    print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""`justfit serve` over HTTP, against a real server subprocess: time to first token
on a long conversation's second turn, concurrent load with a bounded queue, and
a fuzz of malformed or hostile requests.

    python -m bench.serve ttft --context 8000     # turn 2 TTFT >= 10x faster than turn 1
    python -m bench.serve load --clients 8 --requests 20 --max-queue 16 [--max-batch 4]
    python -m bench.serve fuzz --cases 1000 --seed 0
    python -m bench.serve fuzz --cases 1000 --routes /v1/messages,/v1/messages/count_tokens
    python -m bench.serve all

ttft: turn 1 is a ~`--context`-token user message (cold prefill, streamed with
`: prompt_progress` comments); turn 2 appends the reply and a short question and
should reuse the stored state. load: every request must finish (503s carry
Retry-After and are retried), no other 5xx. fuzz: no 5xx, no dropped connection,
/health still answers afterwards. Each runs its own server (fresh state folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time

import aiohttp

from bench.fuzz_cases import Case, make_cases
from bench.server_process import served
from justfit.engine.tickets import TICKET_HEADER


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 3)


# -- ttft ---------------------------------------------------------------------------------
async def chat_turn(session: aiohttp.ClientSession, url: str, msgs: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: TTFT (to the first non-empty content), reply, usage."""
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, parts, usage, progress = time.perf_counter(), None, [], None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
        async for raw in r.content:  # one SSE line at a time
            line = raw.decode().strip()
            if line.startswith(": prompt_progress"):
                progress += 1
            elif line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
                for choice in obj.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        parts.append(text)
    usage = usage or {}
    return {"ttft_s": ttft, "total_s": time.perf_counter() - start, "reply": "".join(parts),
            "prompt_tokens": usage.get("prompt_tokens"), "progress_lines": progress,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def long_message(model: str, n: int) -> str:
    """~n tokens of text, decoded from the model's own tokenizer (cheap to load alone)."""
    from transformers import AutoTokenizer  # after justfit (main imports it first)

    from bench.common import prompt_tokens
    from justfit.model.models import resolve

    tok = AutoTokenizer.from_pretrained(str(resolve(model)))
    return tok.decode(prompt_tokens(tok, n))


async def bench_ttft(args) -> dict:
    text = long_message(args.model, args.context)
    async with served(args.model) as srv, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        # Warm-up on unrelated text: one-time costs (first compile) must not inflate turn 1.
        await chat_turn(s, srv.url, [{"role": "user", "content": "Hello!"}], 2)
        msgs = [{"role": "user", "content": text + "\n\nWhat is this text about?"}]
        one = await chat_turn(s, srv.url, msgs, args.max_tokens)
        msgs += [{"role": "assistant", "content": one["reply"]},
                 {"role": "user", "content": "Now summarize it in one sentence."}]
        two = await chat_turn(s, srv.url, msgs, args.max_tokens)
    ratio = one["ttft_s"] / two["ttft_s"] if one["ttft_s"] and two["ttft_s"] else None
    return {"context": args.context, "turn1": one, "turn2": two, "ttft_turn1_s": one["ttft_s"],
            "ttft_turn2_s": two["ttft_s"], "speedup": ratio, "target_10x_met": bool(ratio and ratio >= 10),
            "turn2_cached_tokens": two["cached_tokens"], "turn1_progress_lines": one["progress_lines"]}


# -- load ---------------------------------------------------------------------------------
def load_request(chat: bool, stream: bool, prompt: str) -> tuple[str, dict]:
    common = {"max_tokens": 8, "temperature": 0, "stream": stream}
    if chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    return "/v1/completions", {"prompt": prompt, **common}


async def body_ok(r: aiohttp.ClientResponse, stream: bool) -> bool:
    """A 200 is only a success if its body is whole: JSON with choices, or SSE to [DONE]."""
    try:
        if not stream:
            return bool((await r.json()).get("choices"))
        lines = [x for x in (await r.text()).splitlines() if x.startswith("data: ")]
        errors = [x for x in lines[:-1] if "error" in json.loads(x[6:])]
        return bool(lines) and lines[-1] == "data: [DONE]" and not errors
    except (ValueError, aiohttp.ClientError):
        return False


async def one_load_request(s: aiohttp.ClientSession, url: str, path: str, body: dict, tally: dict) -> float | None:
    """Send until done (retrying 503s after Retry-After, with the ticket the 503 gave);
    the latency, or None if lost."""
    start, headers = time.perf_counter(), {}
    for _ in range(20):
        try:
            async with s.post(url + path, json=body, headers=headers) as r:
                if r.status == 200:
                    if await body_ok(r, body["stream"]):
                        return time.perf_counter() - start
                    tally["bad_body"] += 1
                    return None
                if r.status != 503:
                    tally["5xx_other" if r.status >= 500 else "other_status"] += 1
                    return None
                tally["503"] += 1
                after = r.headers.get("Retry-After")
                tally["503_without_retry_after"] += after is None
                if r.headers.get(TICKET_HEADER):  # keeps this request's place in line on the retry
                    headers = {TICKET_HEADER: r.headers[TICKET_HEADER]}
                await asyncio.sleep(min(5.0, float(after or 1)))
        except (TimeoutError, aiohttp.ClientError):
            tally["connection_errors"] += 1
            return None
    return None


async def bench_load(args) -> dict:
    tally = dict.fromkeys(["503", "503_without_retry_after", "5xx_other", "other_status", "bad_body",
                           "connection_errors"], 0)
    async with served(args.model, "--max-queue", str(args.max_queue), "--max-batch", str(args.max_batch)) as srv, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def client(c: int) -> list[float | None]:
            prompt = f"Client {c}: name a colour and a number."
            out = []
            for i in range(args.requests):  # alternate chat/completions, then streaming or not
                path, body = load_request(i % 2 == 0, (i // 2) % 2 == 1, prompt)
                out.append(await one_load_request(s, srv.url, path, body, tally))
            return out

        start = time.perf_counter()
        lat = [x for xs in await asyncio.gather(*(client(c) for c in range(args.clients))) for x in xs]
        wall = time.perf_counter() - start
        async with s.get(srv.url + "/v1/justfit/status") as r:
            status = await r.json()
    done = [x for x in lat if x is not None]
    return {"clients": args.clients, "requests_each": args.requests, "max_queue": args.max_queue,
            "max_batch": args.max_batch,
            "total": len(lat), "completed": len(done), "lost": len(lat) - len(done), "retried_503": tally["503"],
            **{k: v for k, v in tally.items() if k != "503"}, "wall_s": round(wall, 2),
            "latency_s": {"p50": pct(done, .5), "p90": pct(done, .9), "p99": pct(done, .99),
                          "max": round(max(done), 3) if done else None},
            "server_memory": status.get("memory"), "server_requests": status.get("requests"),
            "target_met": len(done) == len(lat) and tally["5xx_other"] == 0}


# -- fuzz ---------------------------------------------------------------------------------
async def send_case(s: aiohttp.ClientSession, url: str, case: Case) -> tuple[str, str]:
    try:
        async with s.request(case.method, url + case.path, data=case.body,
                             headers={"Content-Type": case.content_type}) as r:
            return str(r.status), (await r.text(errors="replace"))[:300]
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"conn:{type(e).__name__}", str(e)[:300]


async def bench_fuzz(args) -> dict:
    cases = make_cases(args.cases, args.seed, args.routes.split(",") if args.routes else None)
    hist: dict[str, int] = {}
    failures, conn, oversize = [], [], []
    async with served(args.model, "--max-body", "1MiB", "--max-tokens", "4") as srv:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            start = time.perf_counter()
            for case in cases:
                status, snippet = await send_case(s, srv.url, case)
                hist[status] = hist.get(status, 0) + 1
                example = {"case": case.desc, "method": case.method, "path": case.path, "status": status,
                           "request": case.body[:200].decode(errors="replace"), "response": snippet}
                if status.startswith("5"):
                    failures.append(example)
                elif status.startswith("conn:"):
                    conn.append(example)
                if case.desc.startswith("2 MiB"):
                    oversize.append(status)
            wall = time.perf_counter() - start
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            status, _ = await send_case(s, srv.url, Case("health", "/health", method="GET"))
        alive = srv.proc.poll() is None
        # The last line of each logged traceback: what the server raised, once each.
        raised = re.findall(r"^(\w+(?:Error|Exception)\b.{0,120})", srv.log.read_text(errors="replace"), re.MULTILINE)
    return {"cases": len(cases), "seed": args.seed, "wall_s": round(wall, 2),
            "statuses": dict(sorted(hist.items())), "5xx": len(failures), "connection_errors": len(conn),
            "oversize_413": f"{oversize.count('413')}/{len(oversize)}", "health_after": status,
            "server_alive": alive, "server_exceptions": {e: raised.count(e) for e in sorted(set(raised))},
            "failures": failures[:20], "connection_failures": conn[:20],
            "target_met": not failures and not conn and status == "200" and alive}


# -- main ---------------------------------------------------------------------------------
BENCHES = {"ttft": bench_ttft, "load": bench_load, "fuzz": bench_fuzz}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=[*BENCHES, "all"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8000, help="ttft: tokens in the first user message")
    ap.add_argument("--max-tokens", type=int, default=16, help="ttft: tokens generated per turn")
    ap.add_argument("--clients", type=int, default=8, help="load: concurrent clients")
    ap.add_argument("--requests", type=int, default=20, help="load: requests per client")
    ap.add_argument("--max-queue", type=int, default=16, help="load: the server's --max-queue")
    ap.add_argument("--max-batch", type=int, default=1, help="load: the server's --max-batch")
    ap.add_argument("--cases", type=int, default=1000, help="fuzz: number of requests")
    ap.add_argument("--seed", type=int, default=0, help="fuzz: case generator seed")
    ap.add_argument("--routes", default=None, help="fuzz: comma-separated routes (default: all, "
                                                    "e.g. /v1/messages,/v1/messages/count_tokens)")
    args = ap.parse_args(argv)
    from justfit import runtime

    runtime.setup()  # OpenBLAS before mlx.core
    from bench.common import machine_info, save

    results = {}
    for name in BENCHES if args.which == "all" else [args.which]:
        results[name] = asyncio.run(BENCHES[name](args))
        brief = {k: v for k, v in results[name].items()
                 if k not in ("turn1", "turn2", "failures", "connection_failures", "server_memory")}
        print(json.dumps({"bench": name, **brief}), file=sys.stderr)
    print(f"saved {save('serve', {'machine': machine_info(), 'model': args.model, 'results': results})}",
          file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

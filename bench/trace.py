"""One streamed chat request traced from the socket to the stored state: which of the
project's functions it runs through, and how long each is. What a newcomer reads to
follow a request is these functions; the count and the longest are the figures.

    python -m bench.trace --model smollm2 --max-tokens 16

The server runs in this process (`justfit serve`'s app and listener, on its own loop
thread); every thread's calls are recorded from the request's first byte until its
state is stored, counting functions defined in justfit/, kvexec/, phaseswap/ and
statetrans/ (not cli/ or bench/, which the request does not pass through). A
function's length is its definition's lines, decorators to last line. Writes
bench/results/new/trace-*.json: the functions by package, every one over
`--long-lines` lines, and the longest."""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import sys
import threading
import time
from collections import Counter
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("justfit", "kvexec", "phaseswap", "statetrans")


@cache
def _lengths(path: str) -> dict[int, tuple[str, int]]:
    """Each function in `path` by the first line of its code object (its first decorator,
    or its `def`): (qualified name, lines from that line to its last)."""
    out: dict[int, tuple[str, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                    out[first] = (name, child.end_lineno - first + 1)
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(Path(path).read_text()), "")
    return out


class CallRecorder:
    """The project's functions called on any thread while `recording`."""

    def __init__(self) -> None:
        self.recording = False
        self.seen: set[tuple[str, int]] = set()  # (file, first line)
        self._prefixes = tuple(str(ROOT / p) + "/" for p in PACKAGES)

    def __call__(self, frame, event, arg) -> None:
        if event == "call" and self.recording:
            code = frame.f_code
            if code.co_filename.startswith(self._prefixes):
                self.seen.add((code.co_filename, code.co_firstlineno))

    def install(self) -> None:
        """On this thread and every thread started from now on."""
        threading.setprofile(self)
        sys.setprofile(self)

    def functions(self) -> list[dict]:
        """Every function recorded: its module, name and length (lambdas and
        comprehensions, which have no definition of their own, are left out)."""
        out, names = [], Counter((path, _lengths(path).get(line, ("",))[0]) for path, line in self.seen)
        for path, line in sorted(self.seen):
            found = _lengths(path).get(line)
            if found is not None:
                module = ".".join(Path(path).relative_to(ROOT).with_suffix("").parts)
                name = found[0] if names[path, found[0]] == 1 else f"{found[0]}:{line}"  # a property's getter and setter
                out.append({"module": module, "function": name, "lines": found[1]})
        return out


async def _stream_chat(port: int, max_tokens: int) -> int:
    """One streamed chat request on a new connection; the bytes of its reply."""
    from aiohttp import ClientSession

    body = {"messages": [{"role": "user", "content": "Tell me about the history of the printing press."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            return len(await r.read())


def trace_request(model: str, max_tokens: int) -> list[dict]:
    """Serve `model`, send one streamed chat request, and record every function from
    its send until the scheduler is idle and the stored state is written."""
    from aiohttp import web

    from justfit import Engine
    from justfit.server import Server, ServerConfig, connections

    recorder = CallRecorder()
    recorder.install()  # before the server's threads start: they inherit it
    engine = Engine(model)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = Server(engine, ServerConfig(port=0))

    async def start() -> tuple[web.AppRunner, int]:
        runner = web.AppRunner(server.app(), handler_cancellation=True)
        await runner.setup()
        _, port = await connections.listener(server.config)(runner, "127.0.0.1", 0)
        return runner, port

    runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    asyncio.run(_stream_chat(port, 2))  # a first request: imports and first-call work are not the path
    _until_idle(server)
    recorder.recording = True
    asyncio.run(_stream_chat(port, max_tokens))
    _until_idle(server)
    engine.flush_sessions()
    recorder.recording = False
    threading.setprofile(None)
    sys.setprofile(None)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    return recorder.functions()


def _until_idle(server, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not server.scheduler.idle() and time.monotonic() < end:
        time.sleep(0.01)


def summarize(functions: list[dict], long_lines: int) -> dict:
    """The figures: how many functions, by package, every one over `long_lines`, the
    longest ten, and all of them by module ({module: {function: lines}})."""
    longest = sorted(functions, key=lambda f: -f["lines"])
    by_module: dict[str, dict[str, int]] = {}
    for f in functions:
        by_module.setdefault(f["module"], {})[f["function"]] = f["lines"]
    return {"functions": len(functions),
            "by_package": dict(Counter(f["module"].split(".")[0] for f in functions).most_common()),
            f"over_{long_lines}_lines": {f"{f['module']}.{f['function']}": f["lines"] for f in longest
                                         if f["lines"] > long_lines},
            "longest": {f"{f['module']}.{f['function']}": f["lines"] for f in longest[:10]},
            "by_module": by_module}


def main(argv: list[str] | None = None) -> dict:
    from bench.common import machine_info, save

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--long-lines", type=int, default=60, help="report every function longer than this")
    args = ap.parse_args(argv)
    functions = trace_request(args.model, args.max_tokens)
    result = {"machine": machine_info(), "settings": vars(args), **summarize(functions, args.long_lines)}
    path = save("trace", result)
    over = result[f"over_{args.long_lines}_lines"]
    print(f"{result['functions']} functions from the socket to the stored state "
          f"({', '.join(f'{p} {n}' for p, n in result['by_package'].items())}); "
          f"{len(over)} over {args.long_lines} lines" + "".join(f"\n  {n:4d}  {name}" for name, n in over.items()))
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: JustFit's step loop beside mlx-lm's `generate_step`
on the same weights, on the native path and on the MLX-only path (`JUSTFIT_NATIVE=0`,
what a Mac runs).

    python -m bench.overhead --model smollm2 --contexts 16,1024 --tokens 64 --rounds 3

Systems, each in its own process (the native switch is read when the kernels load):
`justfit` (Engine.generate: the scheduler's step loop, justfit.engine.scheduler
`generate_here`, drafts off, greedy) and `mlx-lm` (mlx-lm's own `generate_step`, its KV
cache and its greedy sampler, on the model JustFit loaded with everything the adapter
installed removed: mlx-lm's modules on JustFit's converted weights, in their dtype);
each `@native` (the default here where the kernels are built) and `@mlx` (JUSTFIT_NATIVE=0).
Not run unless named: `justfit-mlx-cache` (JustFit's loop with mlx-lm's KV cache,
`EngineConfig(kv=None)`, in place of its KV pages: what the pages cost per step) and
`justfit-nopipe` (JustFit's loop with its decode steps not pipelined,
`EngineConfig(pipeline=False)`: each step waits for its tokens before the next is built).
Rounds alternate the systems' order so a shared machine's load falls on all of them.

Per decode token, on the main thread (the one that calls the step):
- wall: elapsed time.
- main-thread CPU: `time.thread_time` over the step, split into
  - host: outside MLX's calls: graph building, hooks, sampling, stops and detokenizing,
    the scheduler;
  - blocked CPU: inside them (`mx.eval`, `mx.async_eval`, `array.item`,
    `array.tolist`): MLX walking the graph and handing each operation to its stream's
    thread (on the CPU backend `async_eval` waits too: it is timed with the waits).
- blocked: wall time inside those calls; `async_eval` the part of it in that call (mlx-lm,
  and JustFit's pipelined steps, dispatch the next step there before waiting for this
  one with `item`).
- off-CPU: wall - blocked - host: time outside MLX's calls the thread did not run
  (preempted on a loaded machine, sleeping).
- syncs: waiting calls (`eval`, `item`, `tolist`) per token; ops: MLX operations (graph
  nodes with a primitive) each token dispatches, counted once per configuration on one
  extra step by writing the graph each call evaluates as DOT (`mx.export_to_dot`) and
  counting its operation nodes, so the counting costs no timed step anything. Arrays
  already evaluated are leaves and not counted; an array `async_eval` already dispatched
  is counted there, not again where `item` waits for it. The figure is what MLX runs, so
  the MLX-only path's is what a Mac would dispatch.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

SYSTEMS = ("justfit@native", "justfit@mlx", "mlx-lm@mlx", "mlx-lm@native")
FIGURES = ("wall_ms", "thread_cpu_ms", "host_ms", "blocked_ms", "blocked_cpu_ms", "off_cpu_ms", "async_eval_ms",
           "syncs", "ops")
_OP = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


@dataclass
class SyncClock:
    """Time the main thread spends inside MLX's evaluating calls (`eval`, `item`,
    `tolist` waits, `async_eval`), with the operations each evaluates counted while
    `counting` is set. `install` wraps the calls; `remove` puts them back."""

    thread: int = field(default_factory=threading.get_ident)
    blocked_wall: float = 0.0
    blocked_cpu: float = 0.0
    async_wall: float = 0.0
    syncs: int = 0
    counting: bool = False
    ops: collections.Counter = field(default_factory=collections.Counter)
    # The arrays the last two `async_eval` calls dispatched (a step's, and the one before).
    _dispatched: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2))
    _originals: dict = field(default_factory=dict)
    _depth: int = 0

    def snapshot(self) -> tuple[float, float, float, int]:
        """(blocked wall, blocked CPU, async_eval wall, syncs) so far."""
        return self.blocked_wall, self.blocked_cpu, self.async_wall, self.syncs

    @staticmethod
    def _leaves(arrays) -> list:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        return [a for _, a in tree_flatten(list(arrays)) if isinstance(a, mx.array)]

    def _count(self, arrays) -> None:
        import mlx.core as mx

        dispatched = {id(d) for call in self._dispatched for d in call}
        leaves = [a for a in self._leaves(arrays) if id(a) not in dispatched]
        if leaves:
            dot = io.StringIO()
            mx.export_to_dot(dot, *leaves)
            self.ops.update(_OP.findall(dot.getvalue()))

    def _waiting(self, original, arrays_of):
        def wrapped(*args, **kwargs):
            if self._depth or threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            if self.counting:
                self._count(arrays_of(args))
            self._depth += 1
            w, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.blocked_cpu += time.thread_time() - c
                self.blocked_wall += time.perf_counter() - w
                self.syncs += 1
                self._depth -= 1
        return wrapped

    def _async(self, original):
        def wrapped(*args, **kwargs):
            if self._depth or threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            if self.counting:
                self._count(args)
            self._depth += 1
            w, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - w
                self.blocked_cpu += time.thread_time() - c
                self.blocked_wall += spent
                self.async_wall += spent
                self._dispatched.append(self._leaves(args))  # lists of arrays too (a batch's rows)
                self._depth -= 1
        return wrapped

    def install(self) -> "SyncClock":
        """Wrap mx.eval, mx.async_eval, array.item and array.tolist (this process)."""
        import mlx.core as mx

        self._originals = {"eval": mx.eval, "async_eval": mx.async_eval, "item": mx.array.item,
                           "tolist": mx.array.tolist}
        mx.eval = self._waiting(mx.eval, lambda args: args)
        mx.async_eval = self._async(mx.async_eval)
        mx.array.item = self._waiting(mx.array.item, lambda args: args[:1])
        mx.array.tolist = self._waiting(mx.array.tolist, lambda args: args[:1])
        return self

    def remove(self) -> None:
        """Put back what `install` wrapped."""
        import mlx.core as mx

        if self._originals:
            mx.eval, mx.async_eval = self._originals["eval"], self._originals["async_eval"]
            mx.array.item, mx.array.tolist = self._originals["item"], self._originals["tolist"]
            self._originals = {}


def measure_steps(clock: SyncClock, steps, tokens: int) -> dict:
    """Pull `tokens` decode tokens from the iterator `steps` (one token each) timed,
    then one more with the operations counted: the per-token figures."""
    blocked0, cpu0, async0, syncs0 = clock.snapshot()
    wall0, thread0 = time.perf_counter(), time.thread_time()
    for _ in range(tokens):
        next(steps)
    wall, thread = time.perf_counter() - wall0, time.thread_time() - thread0
    blocked1, cpu1, async1, syncs1 = clock.snapshot()
    clock.ops.clear()
    clock.counting = True
    try:
        next(steps)
    finally:
        clock.counting = False
    blocked, blocked_cpu = blocked1 - blocked0, cpu1 - cpu0
    host = thread - blocked_cpu
    per = 1e3 / tokens
    return {"tokens": tokens, "wall_ms": wall * per, "host_ms": host * per, "blocked_ms": blocked * per,
            "blocked_cpu_ms": blocked_cpu * per, "off_cpu_ms": (wall - blocked - host) * per,
            "async_eval_ms": (async1 - async0) * per, "thread_cpu_ms": thread * per, "syncs": (syncs1 - syncs0) / tokens,
            "ops": sum(clock.ops.values()), "top_ops": dict(clock.ops.most_common(8)),
            "tps": tokens / wall}


def _justfit_steps(engine, prompt: list[int], tokens: int):
    """Engine.generate's chunks (one a decode step: drafts off, no stop text held back),
    the prompt's first token already taken."""
    from justfit import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens + 3, ignore_eos=True)
    chunks = engine.generate(prompt, sp)
    next(chunks)  # prefill and the first token: not a decode step
    return chunks  # the last token's step also stores the state: never timed


def _mlx_lm_steps(model, prompt: list[int], tokens: int):
    """mlx-lm's generate_step with its own KV cache and greedy sampler, the first token
    already taken."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    cache = make_prompt_cache(model)
    steps = generate_step(mx.array(prompt), model, max_tokens=tokens + 3, sampler=make_sampler(0.0),
                          prompt_cache=cache)
    next(steps)
    return steps, cache


def _worker(system: str, model: str, contexts: list[int], tokens: int) -> dict:
    from justfit import runtime

    runtime.setup()
    from justfit import Engine
    from justfit.config import EngineConfig
    from justfit.model import adapter

    from bench.common import prompt_tokens

    config = EngineConfig(draft="none", context_limit=max(contexts) + tokens + 8)
    if system.startswith("justfit-mlx-cache"):  # mlx-lm's KV cache in JustFit's loop: what the pages cost
        config = replace(config, kv=None)
    if system.startswith("justfit-nopipe"):  # each decode step waits before the next is built
        config = replace(config, pipeline=False)
    engine = Engine(model, config=config)
    facts = {"native": runtime.native_kernels() is not None, "weights": engine.swap.registry.resident_form}
    if system.startswith("mlx-lm"):
        adapter.remove(engine.adapted)  # mlx-lm's modules on the weights as JustFit converted them
    clock = SyncClock().install()
    rows = []
    try:
        for context in contexts:
            prompt = prompt_tokens(engine.tokenizer, context)
            for warm in (True, False):  # the first run pays for first use
                n = 4 if warm else tokens
                if system.startswith("justfit"):
                    steps = _justfit_steps(engine, prompt if not warm else prompt[1:], n)
                    kv = _kv(engine)
                else:
                    steps, cache = _mlx_lm_steps(engine.model, prompt, n)
                    kv = f"mlx-lm {type(cache[0]).__name__} {cache[0].keys.dtype}"
                row = measure_steps(clock, steps, n)
                for _ in steps:  # the rest (the state stored), untimed
                    pass
            rows.append({"context": context, "kv": kv, **row})
    finally:
        clock.remove()
    return {"facts": facts, "rows": rows}


def _kv(engine) -> str:
    kv = engine.config.kv
    if kv is None:
        return "mlx-lm cache"
    from kvexec.calibrate import layer_summary

    return f"{layer_summary(kv.layer_formats) if kv.layer_formats else kv.format} pages"


def run_worker(system: str, model: str, contexts: list[int], tokens: int, timeout: float) -> dict:
    """One system's worker in a fresh process, JUSTFIT_NATIVE set for its path."""
    env = {**os.environ, "JUSTFIT_NATIVE": "0" if system.endswith("@mlx") else "1"}
    cmd = [sys.executable, "-m", "bench.overhead", "--worker", system, model, ",".join(map(str, contexts)),
           str(tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"}
    return json.loads(lines[-1])


def summarize(system: str, runs: list[dict], contexts: list[int]) -> list[dict]:
    """One row per context: each figure's median over the rounds and its spread."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return [{"system": system, "context": c, "error": runs[-1]["error"]} for c in contexts]
    rows = []
    for i, context in enumerate(contexts):
        got = [r["rows"][i] for r in good]
        row = {"system": system, "context": context, "rounds": len(got), "tokens": got[0]["tokens"],
               "kv": got[0]["kv"], **good[0]["facts"], "top_ops": got[0]["top_ops"]}
        for f in FIGURES:
            vals = [g[f] for g in got]
            row[f] = round(statistics.median(vals), 4)
            row[f"{f}_range"] = [round(min(vals), 4), round(max(vals), 4)]
        rows.append(row)
    return rows


def host_ratios(rows: list[dict]) -> list[dict]:
    """JustFit's host time per token over mlx-lm's, per path and context."""
    by = {(r["system"], r["context"]): r for r in rows if "error" not in r}
    out = []
    for (system, context), r in by.items():
        if not system.startswith("justfit"):
            continue
        base = by.get(("mlx-lm@" + system.split("@")[1], context))
        if base and base["host_ms"] > 0:
            out.append({"system": system, "path": system.split("@")[1], "context": context,
                        "host_over_mlx_lm": round(r["host_ms"] / base["host_ms"], 3),
                        "thread_cpu_over_mlx_lm": round(r["thread_cpu_ms"] / base["thread_cpu_ms"], 3),
                        "wall_over_mlx_lm": round(r["wall_ms"] / base["wall_ms"], 3),
                        "ops_justfit": r["ops"], "ops_mlx_lm": base["ops"]})
    return out


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (milliseconds per decode token, medians)."""
    from bench.common import markdown_table

    head = ("| system | context | wall | main-thread CPU | host | blocked | blocked CPU | off-CPU | async_eval "
            "| syncs/tok | ops/tok | tok/s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return markdown_table(head, rows, lambda r: [
        r["system"], str(r["context"]),
        f"{r['wall_ms']:.2f} ({r['wall_ms_range'][0]:.2f}-{r['wall_ms_range'][1]:.2f})", f"{r['thread_cpu_ms']:.2f}",
        f"{r['host_ms']:.2f} ({r['host_ms_range'][0]:.2f}-{r['host_ms_range'][1]:.2f})", f"{r['blocked_ms']:.2f}",
        f"{r['blocked_cpu_ms']:.2f}", f"{r['off_cpu_ms']:.2f}", f"{r['async_eval_ms']:.2f}", f"{r['syncs']:g}",
        f"{r['ops']:g}", f"{1e3 / r['wall_ms']:.1f}"], ("system", "context"))


def main(argv: list[str] | None = None) -> dict:
    """Run every system in alternating rounds, print the table (or the JSON with --json)
    and save the result; a worker (--worker) measures one system and prints its rows."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="16,1024", help="prompt lengths decoded after")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--worker", nargs=4, metavar=("SYSTEM", "MODEL", "CONTEXTS", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        system, model, contexts, tokens = args.worker
        print(json.dumps(_worker(system, model, [int(c) for c in contexts.split(",")], int(tokens))))
        return {}

    from bench.common import machine_info, save

    contexts, systems = [int(c) for c in args.contexts.split(",")], args.systems.split(",")
    load = [os.getloadavg()]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for i in range(args.rounds):
        order = systems if i % 2 == 0 else systems[::-1]
        for system in order:
            runs[system].append(run_worker(system, args.model, contexts, args.tokens, args.timeout))
            print(f"round {i + 1} {system}: " + ("error: " + runs[system][-1]["error"] if "error" in runs[system][-1]
                                                 else "ok"), file=sys.stderr)
    load.append(os.getloadavg())
    rows = [row for s in systems for row in summarize(s, runs[s], contexts)]
    result = {"machine": machine_info(), "command": "python -m bench.overhead " + " ".join(argv or sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
              "load_average": {"before": [round(x, 2) for x in load[0]], "after": [round(x, 2) for x in load[1]]},
              "systems": rows, "host_ratios": host_ratios(rows), "rounds": runs}
    path = save("overhead", result)
    if args.json:
        print(json.dumps(result))
    else:
        print(table(rows))
        for r in result["host_ratios"]:
            print(f"{r['system']} @ {r['context']}: justfit host / mlx-lm host {r['host_over_mlx_lm']}, "
                  f"main thread CPU {r['thread_cpu_over_mlx_lm']}, wall {r['wall_over_mlx_lm']}; "
                  f"ops/token {r['ops_justfit']:g} vs {r['ops_mlx_lm']:g}")
        print(f"saved {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

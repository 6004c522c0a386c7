"""Same request, same reply: each prompt's greedy reply computed cold, then on every other
path the engine can take, each compared token for token with the cold one.

    python -m bench.same_reply --model smollm2 --prompts 50
    python -m bench.same_reply --model gemma3 --prompts 50
    python -m bench.same_reply --model smollm2 --prompts 50 --numerics fast   # the default engine

Prompts (fixed by a rule, not picked by outcome; `prompt_set`): in turn code to copy
(a function of the running Python's standard library, "repeat exactly"), prose (a module
docstring to summarize), and a chat turn (a function shown, a question about it);
SmolLM2 gets them through its chat template, the base model Gemma 3 as plain text
("User: ...\\n\\nAssistant:"). Each is cut to its last `--max-prompt` tokens.

Paths, each against the cold reply (`engine.reset()` first, nothing stored):
repeat (the exact prompt stored: all but its last token reused), prefix (a stored state
sharing two thirds of the prompt), chunk-64 and chunk-2048 (other prefill chunks than
the default 512), batch-4 (run with the next three prompts in one batch), no-drafts
(speculative decoding off for the request: every token a single step), preempted (set
aside on disk halfway through its reply and resumed), restart (after every state went
to disk, a new engine on the same state directory), next-turn (the prompt, its reply
and a follow-up: cold, and resumed from the first turn's stored state, whose reply was
decoded, not prefilled).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import logging
import shlex
import tempfile
import textwrap
import time

PATHS = ("repeat", "prefix", "chunk-64", "chunk-2048", "batch-4", "no-drafts", "preempted", "restart", "next-turn")
MODULES = (difflib, textwrap, shlex, json.decoder, json.encoder, logging, argparse, inspect)
FOLLOW_UP = "\n\nUser: Thank you. Now say it again, shorter.\n\nAssistant:"


def _functions() -> list[str]:
    """Standard-library functions of 12 to 60 lines, in module order then by name, each
    once (a module may bind one under two names)."""
    out = []
    for mod in MODULES:
        for name, obj in sorted(vars(mod).items()):
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                src = textwrap.dedent(inspect.getsource(obj))
                if 12 <= src.count("\n") <= 60 and src not in out:
                    out.append(src)
    return out


def _docstrings() -> list[str]:
    """Module and class docstrings of at least 400 characters, in module order, each once
    (a class bound under two names, logging's, counts once)."""
    out = []
    for mod in MODULES:
        for obj in [mod] + [v for _, v in sorted(vars(mod).items()) if inspect.isclass(v) and v.__module__ == mod.__name__]:
            doc = inspect.getdoc(obj) or ""
            if len(doc) >= 400 and doc not in out:
                out.append(doc)
    return out


def prompt_set(count: int) -> list[tuple[str, list[dict]]]:
    """`count` prompts (kind, chat messages): code, prose and chat turns in turn."""
    code, prose = _functions(), _docstrings()
    out = []
    for i in range(count):
        kind = ("code", "prose", "chat")[i % 3]
        k = i // 3
        if kind == "code":
            text = "Repeat the following Python code exactly:\n\n" + code[(2 * k) % len(code)]
        elif kind == "prose":
            text = "Summarize the following text in three sentences:\n\n" + prose[k % len(prose)]
        else:
            text = ("Here is a Python function:\n\n" + code[(2 * k + 1) % len(code)]
                    + "\nWhat does it return, and when does it raise?")
        out.append((kind, [{"role": "user", "content": text}]))
    return out


def encode(engine, messages: list[dict], chat: bool, limit: int) -> list[int]:
    """The prompt's tokens: through the chat template, or as plain text; at most `limit`."""
    if chat:
        tokens = engine.apply_chat_template(messages)
    else:
        tokens = engine.encode(f"User: {messages[0]['content']}\n\nAssistant:")
    return tokens[-limit:] if len(tokens) > limit else tokens


def _greedy(n: int, **kw):
    from justfit import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _cold(engine, tokens: list[int], sp) -> list[int]:
    engine.reset()
    return engine.reply(tokens, sp).tokens


def _preempted(engine, tokens: list[int], sp) -> list[int]:
    """Set aside on disk after half the reply and resumed (justfit.engine.scheduler's preemption)."""
    from justfit.engine.scheduler import Scheduler, plan_sequence

    engine.reset()
    runner, seq, got, parked = Scheduler(engine, max_batch=4, serve=False), plan_sequence(engine, tokens, sp), [], False
    runner.admit(seq)
    while runner.live:
        if not parked and len(got) >= sp.max_tokens // 2:
            seq.park()
            seq.resume()
            parked = True
        got += [c.token for s, c in runner.step() if c is not None and c.token is not None]
    return got


def _batched(engine, prompts: list[list[int]], sp) -> list[int]:
    """The first prompt's reply, run in one batch with the others."""
    from bench.loop import run_all
    from justfit.engine.scheduler import Scheduler, plan_sequence

    engine.reset()
    runner = Scheduler(engine, max_batch=len(prompts), serve=False)
    seqs = [plan_sequence(engine, p, sp) for p in prompts]
    got = []
    for seq, chunk in run_all(runner, seqs):
        if seq is seqs[0] and chunk is not None and chunk.token is not None:
            got.append(chunk.token)
    return got


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run(model: str, count: int, max_tokens: int, max_prompt: int, deterministic: bool,
        only: tuple[str, ...] = PATHS, log=print) -> dict:
    """Every prompt on every path; per prompt the cold reply's length and, per path,
    None (identical) or the index of the first differing token."""
    from justfit import Engine
    from justfit.config import EngineConfig
    from justfit.model.models import EMBEDDED
    from kvexec import KVConfig

    path = str(EMBEDDED[model]()) if model in EMBEDDED else model
    state_dir = tempfile.mkdtemp(prefix="justfit-same-reply-")

    def engine(**kw):
        return Engine(path, config=EngineConfig(**{"kv": KVConfig(format="calibrated"), "state_dir": state_dir,
                                                   "deterministic": deterministic, **kw}))

    main = engine()
    chat = model != "gemma3"  # the base model reads plain text
    chunked = {n: engine(prefill_chunk=n, state_dir=tempfile.mkdtemp()) for n in (64, 2048)
               if f"chunk-{n}" in only}
    sp = _greedy(max_tokens)
    prompts = [(kind, encode(main, m, chat, max_prompt)) for kind, m in prompt_set(count)]
    rows, colds = [], []
    started = time.perf_counter()
    for i, (kind, tokens) in enumerate(prompts):
        cold = _cold(main, tokens, sp)
        colds.append(cold)
        got: dict[str, list[int]] = {}
        if "repeat" in only:
            got["repeat"] = main.reply(tokens, sp).tokens
        if "prefix" in only:
            main.reset()
            main.reply(tokens[: len(tokens) * 2 // 3] + main.encode(" something else entirely"), _greedy(4))
            got["prefix"] = main.reply(tokens, sp).tokens
        for n, e in chunked.items():
            got[f"chunk-{n}"] = _cold(e, tokens, sp)
        if "batch-4" in only:
            others = [prompts[(i + j) % len(prompts)][1] for j in (1, 2, 3)]
            got["batch-4"] = _batched(main, [tokens] + others, sp)
        if "no-drafts" in only:
            got["no-drafts"] = _cold(main, tokens, _greedy(max_tokens, speculate=False))
        if "preempted" in only:
            got["preempted"] = _preempted(main, tokens, sp)
        if "next-turn" in only:
            turn = tokens + cold + main.encode(FOLLOW_UP)
            cold_turn = _cold(main, turn, sp)
            main.reset()
            main.reply(tokens, sp)
            resumed = main.reply(turn, sp)
            got["next-turn"] = resumed.tokens if resumed.stats.cached_tokens >= len(tokens) else None
            cold = cold_turn  # compared below against the next turn's own cold reply
        row = {"kind": kind, "prompt_tokens": len(tokens), "reply_tokens": len(colds[-1]),
               "paths": {p: (_first_difference(got[p], cold if p == "next-turn" else colds[-1])
                             if got[p] is not None else "not reused") for p in got}}
        rows.append(row)
        log(f"[{i + 1}/{count}] {kind} {len(tokens)} tokens: "
            + " ".join(f"{p}={'=' if d is None else d}" for p, d in row["paths"].items())
            + f" ({time.perf_counter() - started:.0f} s)")
    if "restart" in only:  # every state to disk, then a new engine on the same folder
        main.reset()
        for _, tokens in prompts:
            main.reply(tokens, sp)
        main.states.fit(0)
        del main
        later = engine()
        for row, (_, tokens), cold in zip(rows, prompts, colds):
            again = later.reply(tokens, sp)
            row["paths"]["restart"] = (_first_difference(again.tokens, cold)
                                       if again.stats.restored_from == "disk" else "not restored")
        numerics = later.numerics.as_dict()
    else:
        numerics = main.numerics.as_dict()
    summary = {p: {"identical": sum(r["paths"].get(p, 0) is None for r in rows),
                   "compared": sum(isinstance(r["paths"].get(p, "x"), (int, type(None))) for r in rows)}
               for p in only}
    return {"numerics": numerics, "prompts": rows, "summary": summary, "seconds": round(time.perf_counter() - started)}


def main(argv: list[str] | None = None) -> dict:
    from bench.common import machine_info
    from bench.report import publish

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=512, help="prompt tokens kept (the last ones)")
    ap.add_argument("--numerics", choices=("deterministic", "fast"), default="deterministic",
                    help="deterministic: `--deterministic` (justfit.engine.numerics); fast: the default engine")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    asked = args.numerics == "deterministic"
    only = tuple(p for p in args.paths.split(",") if p)
    unknown = set(only) - set(PATHS)
    if unknown:
        ap.error(f"unknown paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    result = {"suite": "same_reply", "machine": machine_info(),
              "settings": {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                           "max_prompt": args.max_prompt, "numerics": args.numerics, "paths": list(only)},
              **run(args.model, args.prompts, args.max_tokens, args.max_prompt, asked, only,
                    log=lambda s: print(s, flush=True) if not args.json else None)}
    publish("same-reply", result, args.json)
    return result


if __name__ == "__main__":
    main()

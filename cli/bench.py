"""`justfit bench SUITE [ARGS]`: run one of the benchmark scripts in bench/."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import click

from .common import UserError

SUITES = ("batch", "blas", "capacity", "codecs", "footprint", "grammar_libraries", "kv", "parity", "plan", "quality", "resume_peers", "same_reply", "serve", "sessions", "speed", "state", "structured", "trace", "before_after", "overhead", "disk_plan")  # modules of bench/, each with main(argv)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("suite", type=click.Choice(SUITES))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(suite: str, args: tuple[str, ...]) -> None:
    """Run a benchmark suite; ARGS go to it (`justfit bench SUITE --help` lists them).

    \b
    capacity most retained positions per system within a whole-process budget
    speed    prefill/decode speed next to stock mlx-lm
    quality  KV format fidelity: top-1, KL, perplexity, pass-key
    kv       KV transient, bytes per position, decode speed at a context
    codecs   key and value codecs' attention error per layer at equal bits
    grammar_libraries  llguidance against xgrammar: install size, tokenizer memory, compile and mask time
    footprint whole-process peak of one request, JustFit's server against llama-server
    plan     planner's predicted peak vs measured; a run with layers offloaded under a tight budget
    structured  a JSON schema's decode cost against free decoding; forced tokens on against off
    state    time to first token from a snapshot vs cold prefill; snapshot size
    sessions 2 or 4 sessions sharing one budget, swapped to disk in turn
    serve    the HTTP server: second-turn TTFT, concurrent clients, fuzz
    resume_peers  a long conversation's next-turn TTFT against llama-server's prompt cache and slot restore
    same_reply  each prompt's greedy reply cold against every other path (cached, chunked, batched, drafted, ...)
    batch    several requests at once vs one at a time: decode throughput, TTFT during a long prefill
    parity   GGUF import against llama.cpp's reference outputs
    blas     the OpenBLAS preload's effect
    before_after  this checkout's speed against another's, in alternating rounds
    overhead where a decode step's time goes (host, waiting, MLX operations) beside mlx-lm
    trace    one streamed chat request from the socket to the stored state: the functions it runs through
    """
    _find_benchmarks()
    importlib.import_module(f"bench.{suite}").main(list(args))


def _find_benchmarks() -> None:
    """The suites are the repository's bench/, beside cli/, and are not installed: make
    `bench` importable here and in the workers the suites start (`python -m bench.x`)
    from any directory."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "__init__.py").is_file():
        raise UserError("justfit bench runs from a source checkout: the suites are its bench/ folder, "
                        "which installing does not copy")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))

"""A change's effect on speed: this checkout against another (`--before`), in
alternating rounds in one sitting, so that a shared machine's load falls on both.

    python -m bench.before_after --before /tmp/before --rounds 5

Each round runs, in each checkout with its own code (its `.venv`'s Python where it has
one), `bench.speed` (JustFit's default engine: prefill and decode at `--context`
tokens) and `bench.streams` (`justfit serve` with no flags: one stream alone, then
`--streams` at once), the before checkout first in odd rounds and second in even ones.
Reports each figure's median per checkout and the after/before ratio of the medians."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("prefill_tps", "decode_tps", "single_tps", "aggregate_tps")


def _python(tree: Path) -> str:
    venv = tree / ".venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def _run(tree: Path, suite: str, args: list[str], timeout: float) -> str:
    done = subprocess.run([_python(tree), "-m", f"bench.{suite}", *args], cwd=tree, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode:
        raise RuntimeError(f"bench.{suite} in {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def one_round(tree: Path, args) -> dict:
    """The figures of one round in `tree`."""
    speed = _run(tree, "speed", ["--systems", "justfit-default", "--contexts", str(args.context),
                                 "--decode", str(args.decode), "--model", args.model, "--json"], args.timeout)
    row = json.loads(next(line for line in reversed(speed.splitlines()) if line.startswith("{")))["systems"][0]
    streams = _run(tree, "streams", ["--systems", "justfit", "--rounds", "1", "--streams", str(args.streams),
                                     "--max-tokens", str(args.max_tokens), "--model", args.model], args.timeout)
    saved = Path(re.search(r"saved (\S+\.json)", streams).group(1))
    served = json.loads((saved if saved.is_absolute() else tree / saved).read_text())["systems"][0]
    return {"prefill_tps": row["prefill_tps"], "decode_tps": row["decode_tps"],
            "single_tps": served["single_tps"], "aggregate_tps": served["aggregate_tps"]}


def main(argv: list[str] | None = None) -> dict:
    from bench.common import machine_info, save

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="the other checkout (set up: ./dev setup)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": ROOT}
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
            rounds[name].append(one_round(trees[name], args))
            print(f"round {i + 1} {name}: {rounds[name][-1]}", file=sys.stderr)
    medians = {name: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for name, rs in rounds.items()}
    ratios = {f: round(medians["after"][f] / medians["before"][f], 4) for f in FIGURES}
    commits = {name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                    text=True).stdout.strip() for name, t in trees.items()}
    settings = {k: v for k, v in vars(args).items() if k != "before"}
    path = save("before-after", {"machine": machine_info(), "settings": settings, "commits": commits,
                                 "rounds": rounds, "medians": medians, "after_over_before": ratios})
    print(json.dumps({"commits": commits, "after_over_before": ratios}))
    print(f"saved {path}", file=sys.stderr)
    return ratios


if __name__ == "__main__":
    main()

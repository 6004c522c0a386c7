"""The README's speed rows in one sitting: every speed comparison against llama.cpp, each
in alternating rounds, one after another on one quiet machine, and a manifest naming
the result files (`sitting-TIME.json`) that `bench.summary.SITTING` then names.

    bench/sitting.sh DIR                      # DIR: llama.cpp's build/bin
    python -m bench.sitting --llama-cpp DIR [--rounds 3] [--model smollm2] [--dry-run]

Steps (SmolLM2 unless --model; JustFit with drafts off, the same work as llama.cpp's,
and with its n-gram drafts as rows of their own):

- decode after 16 and 1,024 positions, and prefill of 16 and 1,024 tokens, against
  llama-bench (f16 KV, its default);
- prefill of 512 tokens and decode after 16,384 positions held (JustFit: random keys and
  values stored, `bench.speed --depth`; llama-bench: -d, filled for real, once a round);
- one greedy stream (96 tokens after a ~20-token prompt) and 4 at once, over HTTP:
  `justfit serve` (`"speculate": false` / true) against llama-server -np 1 and -np 4;
- where a decode step's time goes (`bench.overhead`), native and MLX-only, beside
  mlx-lm's `generate_step` on the MLX-only path;
- drafts on against drafts off in one `justfit serve` (`bench.speculation --rounds`): chat
  prose, chat, the agent trajectory's first turns and code edits on the chat model.

Each step saves its result into bench/results/new/ as usual; the manifest records each
step's command, result file, wall time and the load average around it. To cite them:
move the four JSON files (and the .md beside each) into bench/results/, set `SITTING` in
bench/summary.py to the manifest's name and run `python -m bench.report`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time


def steps(model: str, llama_cpp: str, rounds: int, decode: int = 64) -> dict[str, list[str]]:
    """Each step's command line (a `python -m bench.…` argv), by name."""
    speed = ["-m", "bench.speed", "--model", model, "--systems", "justfit-nodraft,justfit-drafts",
             "--decode", str(decode), "--repeat", str(rounds), "--llama-cpp", llama_cpp, "--llama-systems", "llama.cpp"]
    return {
        "speed": [*speed, "--contexts", "16,1024"],
        "speed_depth": [*speed, "--contexts", "512", "--depth", "16384"],
        "streams": ["-m", "bench.streams", "--model", model, "--systems",
                    "justfit-nodraft,justfit-drafts,llama-server-np1,llama-server-np4", "--streams", "4",
                    "--max-tokens", "96", "--rounds", str(rounds), "--llama-cpp", llama_cpp],
        "overhead": ["-m", "bench.overhead", "--model", model, "--contexts", "16,1024", "--tokens", str(decode),
                     "--rounds", str(rounds), "--systems",
                     "justfit@native,justfit-nopipe@native,justfit@mlx,justfit-nopipe@mlx,mlx-lm@mlx"],
        "speculation": ["-m", "bench.speculation", "--model", model, "--systems", "justfit", "--rounds", str(rounds),
                        "--max-tokens", "96", "--prompts", "2", "--turns", "4",
                        "--workloads", "prose,chat,agent,code-edit"],
    }


def run_step(argv: list[str], timeout: float) -> dict:
    """Run one step; its result file's stem (from the `saved PATH` line it prints), wall
    time and the load average before and after."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    saved = re.findall(r"saved (\S+\.json)", done.stderr + done.stdout)
    out = {"command": "python " + shlex.join(argv), "wall_s": round(wall, 1), "load_before": round(load, 2),
           "load_after": round(os.getloadavg()[0], 2)}
    if done.returncode or not saved:
        return {**out, "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"}
    return {**out, "result": os.path.basename(saved[-1])[:-len(".json")]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, metavar="DIR",
                    help="llama.cpp's binaries (llama-bench, llama-server)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds in every step (at least 3 to cite)")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded in each speed measurement")
    ap.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per step")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    todo = steps(args.model, args.llama_cpp, args.rounds, args.decode)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    if args.dry_run:
        for name, cmd in todo.items():
            print(f"{name}: python {shlex.join(cmd)}")
        return {}
    from bench.common import machine_info, save

    done = {}
    for name, cmd in todo.items():
        print(f"{name}: python {shlex.join(cmd)}", file=sys.stderr, flush=True)
        done[name] = run_step(cmd, args.timeout)
        print(f"{name}: {done[name]}", file=sys.stderr, flush=True)
    manifest = {"machine": machine_info(), "settings": {"model": args.model, "rounds": args.rounds,
                                                        "decode": args.decode},
                "steps": done, "files": {k: v["result"] for k, v in done.items() if "result" in v},
                "wall_s": round(sum(v["wall_s"] for v in done.values()), 1)}
    path = save("sitting", manifest)
    print(f"saved {path}", file=sys.stderr)
    return manifest


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

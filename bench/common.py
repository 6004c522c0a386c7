"""What every benchmark shares: machine facts, prompts, subprocess workers, results."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# A run saves into bench/results/new/, which git ignores: a file joins bench/results/ (what
# the docs cite, checked by tests/test_docs.py) when moved there to be cited, so a run inside
# a checkout never leaves the suite an uncited file. JUSTFIT_BENCH_RESULTS redirects results
# (tests: a suite run in a subprocess saves there too).
RESULTS = Path(os.environ.get("JUSTFIT_BENCH_RESULTS") or Path(__file__).resolve().parent / "results" / "new")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


# Read when a suite starts (it imports this module first), not when it saves: a long
# run's code is the commit it started on, whatever was committed meanwhile.
_STARTED_AT_COMMIT = _commit()


def machine_info() -> dict:
    from justfit import runtime

    runtime.setup()  # OpenBLAS first
    import mlx.core as mx
    import psutil

    from justfit.blas import active_blas, find_openblas

    commit, openblas = _STARTED_AT_COMMIT, find_openblas()
    from importlib.metadata import version

    return {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(), "mlx_backend": str(mx.default_device()),
        # this process may have loaded MLX before OpenBLAS could be; workers start fresh
        "blas": active_blas(), "worker_blas": f"OpenBLAS ({openblas})" if openblas else "reference BLAS",
        "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
        "python": platform.python_version(), "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }




def machine_line(m: dict) -> str:
    """A result's machine (`machine_info`) on one line, as its tables head it."""
    blas = m.get("blas")
    if m.get("worker_blas") and not str(blas).startswith(m["worker_blas"]):
        blas = f"{m['worker_blas']} in fresh (worker) processes, {blas} in the harness"
    return (f"{m.get('cpu')} x{m.get('cores')}, {m.get('memory_gib')} GiB, MLX {m.get('mlx')} "
            f"({m.get('mlx_backend')}), mlx-lm {m.get('mlx_lm')}, BLAS {blas}, commit {m.get('commit')}, "
            f"{m.get('date')}")


def prompt_tokens(tokenizer, n: int) -> list[int]:
    """n deterministic prompt tokens: the CPython LICENSE text, repeated as needed."""
    path = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
    text = path.read_text(encoding="utf-8") if path.exists() else "The quick brown fox jumps. " * 500
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return (ids * (n // len(ids) + 1))[:n]


def run_worker(module: str, args: list[str], timeout: float, ranks: int = 1) -> dict:
    """Run `python -m module --worker ...` in a fresh process (`ranks` > 1: one per rank
    under justfit.pipeline.launch, as a layer pipeline); its last stdout line is JSON."""
    cmd = [sys.executable, "-m", module, "--worker", *args]
    if ranks > 1:
        from justfit.pipeline.launch import launched

        cmd = launched(ranks, cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def markdown_table(head: str, rows: list[dict], cells, leading: tuple[str, ...]) -> str:
    """`rows` as a markdown table under `head` (its header and separator lines): a row
    with an "error" shows its `leading` fields and the error, any other `cells(row)`."""
    width = head.splitlines()[0].count("|") - 1
    lines = [head]
    for r in rows:
        if "error" in r:
            first = [str(r.get(k)) for k in leading] + [f"error: {r['error']}"]
            lines.append("| " + " | ".join(first + [""] * (width - len(first))) + " |")
        else:
            lines.append("| " + " | ".join(cells(r)) + " |")
    return "\n".join(lines)


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def long_text() -> str:
    """A long natural-language text available offline: the CPython LICENSE followed by
    Debian's common licenses (~250 KB), or the LICENSE alone where those are absent."""
    base = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
    parts = [base.read_text(encoding="utf-8")] if base.exists() else []
    common = Path("/usr/share/common-licenses")
    if common.is_dir():
        parts += [p.read_text(encoding="utf-8", errors="replace") for p in sorted(common.iterdir()) if p.is_file()]
    return "\n\n".join(parts)


def progress_bar(total: int, desc: str, unit: str = "run"):
    """A progress bar on stderr for a long run; hidden when stderr is not a terminal
    (logs, tests, --json pipelines read stdout only)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, dynamic_ncols=True,
                leave=True)


def apply_quick(args, preset: dict, argv: list[str] | None) -> None:
    """With --quick, the preset's values for every option the command line left out."""
    if not getattr(args, "quick", False):
        return
    given = argv if argv is not None else sys.argv
    for key, value in preset.items():
        if f"--{key.replace('_', '-')}" not in given:
            setattr(args, key, value)

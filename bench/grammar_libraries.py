"""The constrained-decoding library, measured: llguidance against xgrammar on the
embedded models' vocabularies (SmolLM2's 49,152 tokens, Gemma 3's 262,144).

    python -m bench.grammar_libraries --xgrammar-python /tmp/xgr-venv/bin/python

Per library and model, in a fresh process each (`--worker`): resident bytes and time
to import the library, then to build its tokenizer (llguidance's LLTokenizer,
xgrammar's TokenizerInfo) from the model's token bytes; the compile time of a typical
schema (a pydantic model with nested objects, a list, an enum and optional fields),
each compile fresh (xgrammar's cache off), and its first mask; and the mask time of
every token of a valid instance of that schema, forced through the matcher one token
at a time (the median of each token's best of `--rounds`). Both libraries get the same
vocabulary (every token's bytes, control tokens special) and flexible whitespace.

xgrammar requires torch, transformers and triton and imports torch and transformers
when imported: it runs from a separate virtual environment (`--xgrammar-python`),
never JustFit's. `--footprint` sizes each library's install from pip's resolution
(`pip install --dry-run --report`): every wheel's download size and the bytes of the
installed files in the environment that runs it."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {"llguidance": "llguidance==1.9.1", "xgrammar": "xgrammar==0.2.8"}
MODELS = ("smollm2", "gemma3")
SPECIAL_TYPES = (2, 3, 5)  # GGUF token types: unknown, control, unused
BYTE_TYPE, USER_TYPE = 6, 4


def typical_schema() -> tuple[dict, dict]:
    """(JSON schema, a valid instance): an order, as pydantic writes its schema."""
    from enum import Enum
    from typing import Optional

    from pydantic import BaseModel

    class Priority(str, Enum):
        low, normal, urgent = "low", "normal", "urgent"

    class Address(BaseModel):
        street: str
        city: str
        postcode: str
        country: str

    class Item(BaseModel):
        sku: str
        quantity: int
        unit_price: float
        gift_wrap: bool = False

    class Order(BaseModel):
        order_id: int
        customer: str
        email: Optional[str] = None
        shipping: Address
        items: list[Item]
        priority: Priority
        notes: Optional[str] = None

    instance = {"order_id": 48213, "customer": "Maria Okafor", "email": "maria.okafor@example.com",
                "shipping": {"street": "14 Harbour Lane", "city": "Bristol", "postcode": "BS1 4RN",
                             "country": "United Kingdom"},
                "items": [{"sku": "TEA-0042", "quantity": 2, "unit_price": 7.5, "gift_wrap": False},
                          {"sku": "MUG-1180", "quantity": 1, "unit_price": 12.99, "gift_wrap": True},
                          {"sku": "BIS-0007", "quantity": 3, "unit_price": 3.25, "gift_wrap": False}],
                "priority": "normal", "notes": None}
    Order.model_validate(instance)
    return Order.model_json_schema(), instance


def token_bytes(meta: dict) -> tuple[list[bytes], list[int]]:
    """Every token's bytes from a GGUF's tokenizer metadata, and the special tokens' ids
    (control, unknown, unused: text no reply spells)."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    if meta["tokenizer.ggml.model"] == "gpt2":
        from justfit.model.bytelevel import _byte_alphabet

        byte_of = {c: b for b, c in enumerate(_byte_alphabet())}

        def normal(piece: str) -> bytes:
            return bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
    else:  # SentencePiece: U+2581 stands for a space

        def normal(piece: str) -> bytes:
            return piece.replace("\u2581", " ").encode()
    out, special = [], []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind in SPECIAL_TYPES:
            special.append(i)
            out.append(piece.encode())
        elif kind == BYTE_TYPE and piece.startswith("<0x"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.encode() if kind == USER_TYPE else normal(piece))
    return out, special


def vocabulary_case(model: str) -> dict:
    """What a worker needs, in plain JSON (xgrammar's environment has no JustFit): the
    model's token bytes, special and end tokens, the schema and its instance's tokens."""
    from justfit.model.gguf.file import read_gguf
    from justfit.model.models import EMBEDDED, load

    meta, _ = read_gguf(str(EMBEDDED[model]()))
    tokens, special = token_bytes(meta)
    loaded = load(model, lazy=True)
    schema, instance = typical_schema()
    ids = list(loaded.tokenizer.encode(json.dumps(instance), add_special_tokens=False))
    eos = sorted(loaded.tokenizer.eos_token_ids)
    assert b"".join(tokens[i] for i in ids) == json.dumps(instance).encode(), "token bytes do not spell the text"
    return {"model": model, "tokens": [t.hex() for t in tokens], "special": special, "eos": eos,
            "schema": schema, "instance_tokens": ids}


def _rss() -> int:
    with open("/proc/self/statm") as f:  # Linux; the workers need no psutil
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Llguidance:
    """llguidance behind the worker's four steps."""

    def __init__(self):
        import llguidance
        import llguidance.numpy

        self.lib, self.np = llguidance, llguidance.numpy

    def tokenizer(self, case: dict, tokens: list[bytes], encode):
        class Vocabulary:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = case["eos"][0], None
            special_token_ids = case["special"]

            def __init__(self):
                self.tokens = tokens

            def __call__(self, text):  # llguidance tokenizes forced text with it
                if not isinstance(text, str):
                    raise TypeError("text, not bytes")
                return encode(text, add_special_tokens=False)

        return self.lib.LLTokenizer(self.lib.TokenizerWrapper(Vocabulary()), eos_token=case["eos"])

    def compile(self, tokenizer, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        matcher = self.lib.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def mask(self, tokenizer):
        return self.np.allocate_token_bitmask(1, tokenizer.vocab_size)

    def fill(self, matcher, mask) -> None:
        self.np.fill_next_token_bitmask(matcher, mask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class _Xgrammar:
    """xgrammar behind the worker's four steps."""

    def __init__(self):
        import xgrammar

        self.lib = xgrammar

    def tokenizer(self, case: dict, tokens: list[bytes], encode):
        # special tokens as empty strings: xgrammar's way of keeping them out of every mask
        vocab = [b"" if i in set(case["special"]) else t for i, t in enumerate(tokens)]
        return self.lib.TokenizerInfo(vocab, self.lib.VocabType.RAW, stop_token_ids=case["eos"])

    def compile(self, tokenizer, schema: dict):
        compiler = self.lib.GrammarCompiler(tokenizer, cache_enabled=False)
        return self.lib.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=True))

    def mask(self, tokenizer):
        import numpy as np

        return np.full((1, (tokenizer.vocab_size + 31) // 32), -1, dtype=np.int32)

    def fill(self, matcher, mask) -> None:
        matcher.fill_next_token_bitmask(mask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def _allowed(mask, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def worker(library: str, case_file: str, rounds: int) -> dict:
    """One library on one model's vocabulary, in this (fresh) process."""
    case = json.loads(Path(case_file).read_text())
    tokens = [bytes.fromhex(t) for t in case.pop("tokens")]
    encode = None
    if library == "llguidance":  # it tokenizes forced text: with JustFit's tokenizer, as the engine would
        from justfit.model.models import load

        encode = load(case["model"], lazy=True).tokenizer.encode
    import numpy  # noqa: F401  (both need it; JustFit holds it already)

    gc.collect()
    rss0, t0 = _rss(), time.perf_counter()
    lib = _Llguidance() if library == "llguidance" else _Xgrammar()
    rss1, t1 = _rss(), time.perf_counter()
    tokenizer = lib.tokenizer(case, tokens, encode)
    t2 = time.perf_counter()
    gc.collect()
    rss2 = _rss()
    compiles, firsts, per_token = [], [], [[] for _ in case["instance_tokens"]]
    for _ in range(rounds):
        start = time.perf_counter()
        matcher = lib.compile(tokenizer, case["schema"])
        mask = lib.mask(tokenizer)
        compiled = time.perf_counter()
        lib.fill(matcher, mask)
        compiles.append(compiled - start)
        firsts.append(time.perf_counter() - compiled)
        for i, token in enumerate(case["instance_tokens"]):
            start = time.perf_counter()
            lib.fill(matcher, mask)
            per_token[i].append(time.perf_counter() - start)
            if not _allowed(mask, token) or not lib.consume(matcher, token):
                raise AssertionError(f"{library} refused token {i} ({token}) of a valid instance")
        lib.fill(matcher, mask)
        if not all(_allowed(mask, e) for e in case["eos"][:1]):
            raise AssertionError(f"{library} does not allow the end after a complete instance")
    best = sorted(min(t) for t in per_token)
    return {"library": library, "model": case["model"], "vocab_size": len(tokens),
            "import_s": round(t1 - t0, 4), "import_rss_bytes": rss1 - rss0,
            "tokenizer_s": round(t2 - t1, 4), "tokenizer_rss_bytes": rss2 - rss1,
            "compile_ms_median": round(statistics.median(compiles) * 1e3, 3),
            "first_mask_ms_median": round(statistics.median(firsts) * 1e3, 3),
            "mask_tokens": len(best), "mask_us_median": round(statistics.median(best) * 1e6, 2),
            "mask_us_p90": round(best[int(0.9 * (len(best) - 1))] * 1e6, 2),
            "mask_us_max": round(best[-1] * 1e6, 2), "rounds": rounds}


def _wheel_bytes(url: str) -> int:
    if url.startswith("file://"):
        from urllib.parse import unquote

        return os.path.getsize(unquote(url[len("file://"):]))
    from urllib.request import Request, urlopen

    with urlopen(Request(url, method="HEAD"), timeout=60) as answer:
        return int(answer.headers["Content-Length"])


_INSTALLED = """import importlib.metadata as m, json, sys
names = set(json.loads(sys.argv[1]))
out = {}
for d in m.distributions():
    n = d.metadata["Name"].lower().replace("_", "-")
    if n in names:
        out[n] = sum(d.locate_file(f).stat().st_size for f in d.files or [] if d.locate_file(f).is_file())
print(json.dumps(out))"""


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def footprint(requirement: str, python: str) -> dict:
    """What installing `requirement` brings (pip's resolution, from nothing installed):
    each wheel's download bytes, the installed bytes of those present in `python`'s
    environment, and which of them JustFit's own environment (this process's) lacks."""
    from importlib.metadata import PackageNotFoundError, distribution

    with tempfile.TemporaryDirectory() as d:
        subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
                        f"{d}/report.json", requirement], check=True, timeout=900, capture_output=True)
        report = json.loads(Path(d, "report.json").read_text())
    wheels = {_normal(i["metadata"]["name"]): (i["metadata"]["version"], _wheel_bytes(i["download_info"]["url"]))
              for i in report["install"]}
    done = subprocess.run([python, "-c", _INSTALLED, json.dumps(sorted(wheels))], check=True, capture_output=True,
                          text=True, timeout=300)
    installed = json.loads(done.stdout)

    def in_justfit(name: str) -> bool:
        try:
            distribution(name)
            return True
        except PackageNotFoundError:
            return False

    new = [n for n in wheels if not in_justfit(n)]
    largest = sorted(wheels, key=lambda n: -wheels[n][1])[:8]
    return {"requirement": requirement, "wheels": len(wheels), "download_bytes": sum(s for _, s in wheels.values()),
            "installed_bytes": sum(installed.values()), "installed_measured": len(installed),
            "new_to_justfit": len(new), "new_to_justfit_download_bytes": sum(wheels[n][1] for n in new),
            "new_to_justfit_installed_bytes": sum(installed.get(n, 0) for n in new),
            "largest": [{"name": n, "version": wheels[n][0], "download_bytes": wheels[n][1],
                         "installed_bytes": installed.get(n)} for n in largest]}


def run_worker(python: str, library: str, case_file: str, rounds: int, timeout: float) -> dict:
    """`worker` in a fresh process of `python`; its result or {"error": ...}."""
    cmd = [python, "-m", "bench.grammar_libraries", "--worker", library, case_file, "--rounds", str(rounds)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"library": library, "error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"library": library, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    from bench.common import markdown_table

    head = ("| model (vocabulary) | library | import: MiB, s | tokenizer: MiB, s | compile ms | first mask ms "
            "| mask µs median / p90 / max |\n|---|---|---|---|---|---|---|")
    return markdown_table(head, rows, lambda r: [
        f"{r['model']} ({r['vocab_size']:,})", r["library"], f"{r['import_rss_bytes'] / 2**20:.1f}, {r['import_s']:.2f}",
        f"{r['tokenizer_rss_bytes'] / 2**20:.1f}, {r['tokenizer_s']:.2f}", f"{r['compile_ms_median']:.2f}",
        f"{r['first_mask_ms_median']:.2f}",
        f"{r['mask_us_median']:.1f} / {r['mask_us_p90']:.1f} / {r['mask_us_max']:.1f}"], ("model", "library"))


def main(argv: list[str] | None = None) -> dict:
    """Measure both libraries on each model; save and print the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("LIBRARY", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--rounds", type=int, default=5, help="compiles, and passes of the instance, per worker")
    ap.add_argument("--xgrammar-python", default="/tmp/xgr-venv/bin/python",
                    help="a Python with xgrammar (and so torch) installed: never JustFit's environment")
    ap.add_argument("--footprint", action="store_true", help="also size each install (asks the package index)")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.worker:
        result = worker(args.worker[0], args.worker[1], args.rounds)
        print(json.dumps(result))
        return result
    from bench.common import machine_info, save

    pythons = {"llguidance": sys.executable, "xgrammar": args.xgrammar_python}
    libraries = args.libraries.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for model in args.models.split(","):
            case_file = Path(d, f"{model}.json")
            case_file.write_text(json.dumps(vocabulary_case(model)))
            for library in libraries:
                row = run_worker(pythons[library], library, str(case_file), args.rounds, args.timeout)
                rows.append({"model": model, **row})
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    result = {"machine": machine_info(), "settings": {"rounds": args.rounds, "models": args.models,
                                                      "libraries": args.libraries}, "rows": rows}
    if args.footprint:
        result["footprint"] = {lib: footprint(LIBRARIES[lib], pythons[lib]) for lib in libraries}
    result["versions"] = {lib: subprocess.run([pythons[lib], "-c", f"import importlib.metadata as m; "
                                               f"print(m.version('{lib}'))"], capture_output=True, text=True
                                              ).stdout.strip() for lib in libraries}
    path = save("grammar-libraries", result)
    print(table(rows))
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()

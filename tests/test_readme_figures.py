"""The results table in the README (and docs/BENCHMARKS.md) claims only what its result
files hold: every figure in a row is found, as shown or rounded to what is shown, in a
file that row cites (a ratio may instead be the quotient of two of the row's figures),
and the table is what `python -m bench.report` writes from today's files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import summary

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "BENCHMARKS.md"]
RESULT = re.compile(r"\b([a-z]+(?:-[a-z0-9]+)*-\d{8}(?:-\d{6})?(?:-[a-z0-9]+)?)\b")
# A figure: 24,288 / 633.6 / 3.4e-4, then % or x; not part of a name (SmolLM2, q8_0, top-1, 270M).
FIGURE = re.compile(r"(?<![\w.\-/])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?(?:e-?\d+)?)([%x]?)(?![\w.])")
NAMES = re.compile(r"Gemma 3|SmolLM2")


def _table(text: str) -> list[list[str]]:
    """The rows (cells) between the results-table markers."""
    start = text.index("<!-- results-table:begin")
    body = text[start:text.index(summary.END, start)].splitlines()[1:]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body if line.startswith("|")]
    return rows[2:]  # header and rule


def _figures(cell: str) -> list[tuple[float, str, str]]:
    """(value, as written, suffix) for each figure in a cell, code spans and model names aside."""
    text = NAMES.sub("", re.sub(r"`[^`]*`", "", cell))
    return [(float(m[1].replace(",", "")), m[1], m[2]) for m in FIGURE.finditer(text)]


def _numbers(value) -> list[float]:
    """Every number in a result: JSON values, and numbers written inside its strings."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        return [float(m[1].replace(",", "")) for m in FIGURE.finditer(value)]
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _numbers(k) + _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _source_numbers(stem: str) -> list[float]:
    found = []
    for path in sorted(summary.RESULTS.glob(f"{stem}*")):
        if path.suffix == ".json":
            found += _numbers(json.loads(path.read_text()))
        elif path.suffix == ".md":
            found += _numbers(path.read_text())
    assert found, f"{stem}: no such result file in bench/results/"
    return found


def _shown_as(written: str, suffix: str, n: float) -> bool:
    """Whether the number n, rounded as `written` is, reads `written` (a share may be
    stored as a fraction and shown as a percentage)."""
    target = float(written.replace(",", ""))
    if "e" in written:
        mantissa, exponent = written.split("e")
        half = 0.5 * 10 ** (int(exponent) - len(mantissa.partition(".")[2]))
    else:
        half = 0.5 * 10 ** -len(written.partition(".")[2])
    candidates = [n, n * 100] if suffix == "%" else [n]
    return any(abs(c - target) <= half * (1 + 1e-9) for c in candidates)


def _quotient(value: float, figures: list[float]) -> bool:
    return any(b and abs(a / b - value) <= 0.006 for a in figures for b in figures if a is not b)


def _rows() -> list[tuple[Path, list[str]]]:
    return [(doc, row) for doc in DOCS for row in _table(doc.read_text())]


def test_the_table_is_generated_from_todays_files():
    """The docs hold what `python -m bench.report` writes now (rerun it after a new result)."""
    block = summary.block()
    for doc in DOCS:
        assert summary.splice(doc.read_text(), block) == doc.read_text(), f"{doc.name}: run python -m bench.report"


@pytest.mark.parametrize("doc,row", _rows(), ids=lambda x: x.name if isinstance(x, Path) else x[0][:40])
def test_every_figure_is_in_a_file_the_row_cites(doc, row):
    header = ["measured", "JustFit", "compared with", "result files", "rerun"]
    assert len(row) == len(header), f"{doc.name}: a row of {len(row)} cells: {row}"
    cells = dict(zip(header, row))
    stems = RESULT.findall(cells["result files"])
    figures = [f for key in ("measured", "JustFit", "compared with") for f in _figures(cells[key])]
    if not stems:
        assert not figures, f"{doc.name}: figures with no result file cited: {row[0]}"
        return
    numbers = [n for stem in stems for n in _source_numbers(stem)]
    plain = [v for v, _, suffix in figures if suffix != "x"]
    missing = [written + suffix for value, written, suffix in figures
               if not any(_shown_as(written, suffix, n) for n in numbers)
               and not (suffix == "x" and _quotient(value, plain))]
    assert not missing, f"{doc.name}, {row[0]}: not in {stems}: {missing}"


def test_the_check_catches_a_figure_no_file_holds():
    """A figure the cited file lacks, or one rounded wrongly, fails the check; names and
    code spans are not figures."""
    numbers = _numbers({"positions": 24288, "top1": 0.992674, "kl": 0.00033763, "tps": 633.6353})
    assert all(any(_shown_as(w, s, n) for n in numbers) for _, w, s in _figures("24,288; 99.27%; 3.4e-4; 633.6"))
    for wrong in ("24,289", "99.28%", "99.2%", "3.5e-4", "633.7", "635"):
        assert not any(_shown_as(w, s, n) for n in numbers for _, w, s in _figures(wrong)), wrong
    assert _quotient(1.04, [24288.0, 23296.0]) and not _quotient(1.10, [24288.0, 23296.0])
    assert _figures("SmolLM2 q8_0 f16 top-1 Gemma 3 270M `--step 1024`") == []


def test_fidelity_rows_read_every_system_from_one_named_run(tmp_path, monkeypatch):
    """Each model's fidelity row reads JustFit, llama.cpp's lossy caches and mlx-lm's
    quantized KV from the one run it names (llama.cpp's f16 row, its reference, left
    out), and says where mlx-lm quantized only some layers."""
    rows = [{"system": "justfit-calibrated", "top1": 0.9922, "kl": 2.4e-4, "chunks": 4, "context": 2048, "scored": 4092},
            {"system": "llama.cpp-f16", "format": "f16", "top1": 1.0, "kl": 0.0},
            {"system": "llama.cpp-q8_0", "format": "q8_0", "top1": 0.9563, "kl": 0.0105},
            {"system": "mlx-lm-kv8", "format": "q8g64", "error": "not measured"},
            {"system": "mlx-lm-kv8-float32-dense", "format": "q8g64", "top1": 0.9866, "kl": 1.0e-3,
             "kv_cache": "QuantizedKVCache in 3 of 18 layers, from the first token"}]
    (tmp_path / "quality-20990101-000000.json").write_text(json.dumps({"machine": {}, "systems": rows}))
    monkeypatch.setattr(summary, "PEER_FIDELITY", {"Gemma 3": ("quality-20990101-000000", "cmd")})
    [row] = summary.fidelity_rows(tmp_path)
    assert row.sources == ("quality-20990101-000000",) and "4 windows of 2,048 tokens" in row.what
    assert row.justfit.startswith("default pages: top-1 99.22%, KL 2.4e-4")
    assert "llama.cpp q8_0 KV: top-1 95.63%, KL 1.1e-2 (each against llama.cpp's f16 KV)" in row.baseline
    assert "f16 KV:" not in row.baseline and row.baseline.count("mlx-lm") == 1
    assert "mlx-lm q8g64 KV in 3 of 18 layers (its full-attention ones): top-1 98.66%" in row.baseline

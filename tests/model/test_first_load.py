"""A model's first load (conversion, calibration) planned like a request under a
whole-process budget: its peak predicted from shapes against the one measured, refused
before any work with the numbers, and only what remains predicted once converted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from justfit.config import EngineConfig
from justfit.engine.facade import Engine
from justfit.errors import FirstLoadExceeded
from justfit.memory import format_size
from justfit.model.gguf.cache import RequantOptions, converted_path
from kvexec import KVConfig
from tests.helpers.tiny_models import write_gemma3_gguf, write_llama_gguf

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
CALIBRATED = KVConfig(format="calibrated")
# The real models' band: 10% of the whole peak (docs/BENCHMARKS.md has their figures).
# A tiny model's own terms are a few MiB of a process of about eighty; the prediction's
# model-independent terms (library code, what a conversion leaves, the floor) are sized
# on real models and come out a few MiB high here, so the band is wider by that much.
BAND, TINY = 0.10, 8 * MiB


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("JUSTFIT_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "cache"


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def _child(model: Path, budget: int, cache: Path) -> dict:
    env = {**os.environ, "JUSTFIT_CACHE": str(cache), "JUSTFIT_STATE_DIR": str(cache.parent / "state")}
    done = subprocess.run([sys.executable, "-m", "tests.helpers.first_load_child", str(model), str(budget)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable VmHWM")
@pytest.mark.parametrize("write", [write_llama_gguf, write_gemma3_gguf], ids=["llama", "gemma3"])
def test_first_load_peak_is_predicted_within_its_band(write, tmp_path):
    model = tmp_path / "tiny.gguf"
    write(model)
    got = _child(model, 4 << 30, tmp_path / "cache")
    assert got.get("loaded"), got
    assert {"GGUF metadata", "calibration records"} & set(got["parts"])  # a step was predicted, not a bare load
    assert got["peak_rss"] <= got["predicted"] <= (1 + BAND) * got["peak_rss"] + TINY, (
        f"predicted {got['predicted'] / MiB:.1f} MiB, measured {got['peak_rss'] / MiB:.1f} MiB: {got['parts']}")
    assert _files(tmp_path / "cache" / "models") and _files(tmp_path / "cache" / "calibration")


def test_a_first_load_over_the_budget_is_refused_before_any_work(tmp_path, cache):
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(model)
    config = EngineConfig(kv=CALIBRATED, budget_covers_process=True)
    first = Engine.first_load(str(model), config)
    assert first.convert and first.calibrate
    budget = first.peak - 10 * MiB
    with pytest.raises(FirstLoadExceeded) as refused:
        Engine(str(model), budget=budget, config=config)
    message = str(refused.value)
    assert f"budget {format_size(budget)}" in message
    assert format_size(refused.value.peak) in message and refused.value.peak > budget
    assert "calibration records" in message and "outside MLX now" in message  # the parts
    assert "--kv-format q8c" in message and "without --budget" in message  # the ways out
    assert _files(cache) == []  # nothing converted, nothing measured


def test_only_what_remains_is_predicted(tmp_path, cache):
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(model)
    converted_path(model, RequantOptions())
    first = Engine.first_load(str(model), EngineConfig(kv=CALIBRATED))
    assert not first.convert and first.calibrate  # converted: the calibration is left
    assert not Engine.first_load(str(model), EngineConfig(kv=KVConfig(format="q8c"))).pending
    Engine(str(model), config=EngineConfig(kv=CALIBRATED))  # converted and calibrated, cached
    assert not Engine.first_load(str(model), EngineConfig(kv=CALIBRATED)).pending


def test_fit_shows_the_first_load_before_doing_it(tmp_path, cache):
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(model)
    first = Engine.first_load(str(model), EngineConfig(kv=CALIBRATED))
    runner = CliRunner()
    report = json.loads(runner.invoke(main, ["fit", "--model", str(model), "--json"]).output)
    assert set(report["first_load"]["convert"]) == set(first.convert)  # predicted, then done by the load
    assert set(report["first_load"]["calibrate"]) == set(first.calibrate)
    assert abs(report["first_load"]["peak"] - first.peak) < 8 * MiB  # the same prediction, outside measured again
    again = runner.invoke(main, ["fit", "--model", str(model)])
    assert again.exit_code == 0 and "first load" not in again.output  # converted and calibrated now


@pytest.mark.parametrize("write", [write_llama_gguf, write_gemma3_gguf], ids=["llama", "gemma3"])
def test_the_header_predicts_the_converted_weights_exactly(write, tmp_path, cache):
    import mlx.core as mx

    from justfit.model.gguf.file import read_gguf, read_header
    from justfit.model.gguf.footprint import header_footprint

    model = tmp_path / "tiny.gguf"
    write(model)
    meta, tensors = read_header(str(model))
    full, mapped = read_gguf(str(model))
    assert [(t.name, t.tensor_type, t.shape) for t in mapped] == tensors
    assert {k: len(v) for k, v in full.items() if isinstance(v, list)} == \
        {k: len(v) for k, v in meta.items() if not isinstance(v, (str, int, float, bool))}
    step = header_footprint(meta, tensors, RequantOptions())
    weights = mx.load(str(converted_path(model, RequantOptions()) / "model.safetensors"))
    assert step.converted == sum(a.nbytes for a in weights.values())  # every tensor's converted bytes

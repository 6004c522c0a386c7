"""The whole-process breakdown (justfit.planning.breakdown): its measured parts add up to the
process's RSS on a tiny GGUF model, after load and after a request, and `justfit fit`
and `/v1/justfit/status`'s data carry it."""

from __future__ import annotations

import gc
import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from cli.main import main
from justfit import Engine, SamplingParams
from justfit.planning.breakdown import HOW, format_breakdown, measured, process_breakdown
from tests.helpers.tiny_models import write_gemma3_gguf, write_llama_gguf

TOLERANCE = 0.05  # the measured parts, without `unaccounted`, within 5% of RSS


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_gguf(request, tmp_path_factory, monkeypatch_module):
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    {"llama": write_llama_gguf, "gemma3": write_gemma3_gguf}[request.param](path)
    return path


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("JUSTFIT_CACHE", str(tmp_path_factory.mktemp("cache")))  # converted here, not in the user's cache
    mp.setenv("JUSTFIT_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    yield mp
    mp.undo()


def _check_sum(b: dict) -> None:
    parts = b["parts"]
    assert set(parts) == set(HOW)
    assert all(v >= 0 for k, v in parts.items() if k != "unaccounted"), parts
    measured_sum = sum(v for k, v in parts.items() if k != "unaccounted")
    assert measured_sum + parts["unaccounted"] == b["rss"]
    assert abs(b["rss"] - measured_sum) <= TOLERANCE * b["rss"], (b["rss"], parts)


def test_parts_add_up_to_rss_after_load_and_after_a_request(tiny_gguf):
    # The load marks what the process held before the model as staying: garbage earlier
    # tests left would be in that mark and then collected below (the MLX-only pass of a
    # whole suite in one process counted 21 MB more than its RSS).
    gc.collect()
    engine = Engine(str(tiny_gguf))
    loaded = process_breakdown(engine)
    _check_sum(loaded)
    assert loaded["parts"]["weights"] == engine.swap.registry.resident_bytes() > 0
    assert loaded["parts"]["modules"] > 0 and loaded["parts"]["libraries"] > 0
    assert loaded["parts"]["pages"] == loaded["parts"]["hot_window"] == 0  # nothing computed yet

    gc.collect()
    active_loaded = mx.get_active_memory()
    ids = engine.tokenizer.encode("the quick brown fox " * 40)[:200]
    assert len(ids) == 200  # longer than the first chunk and the sinks
    reply = engine.reply(ids, SamplingParams(temperature=0, max_tokens=8))
    after = process_breakdown(engine, last=reply.stats)
    _check_sum(after)
    held = after["parts"]["pages"] + after["parts"]["hot_window"]
    assert held == engine.states.memory_bytes > 0  # the stored state's KV, split into pages and hot window
    # and what MLX holds is what they count: no array keeps a larger buffer alive (views of
    # the first chunk's keys, of a trimmed hot window's room, once did)
    gc.collect()
    assert mx.get_active_memory() - active_loaded <= held + (64 << 10)
    assert after["parts"]["token_lists"] > 8 * len(ids)  # at least a pointer per stored token
    assert after["peaks"]["transient"] is not None and after["peaks"]["process"] >= after["rss"]
    text = "\n".join(format_breakdown(after))
    assert "tokenizer" in text and "unaccounted" in text and "RssAnon" in text


def test_measured_sees_what_a_step_leaves_resident():
    keep = []
    _, size = measured(lambda: keep.append(bytearray(32 << 20)))  # 32 MiB, written: resident
    assert 30 << 20 <= size <= 40 << 20
    keep.clear()
    _, size = measured(lambda: len(bytearray(32 << 20)))  # freed before the second reading
    assert size < 4 << 20


def test_fit_shows_the_breakdown(tiny_gguf):
    runner = CliRunner()
    result = runner.invoke(main, ["fit", "--model", str(tiny_gguf), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    _check_sum(report["process"])
    text = runner.invoke(main, ["fit", "--model", str(tiny_gguf)])
    assert text.exit_code == 0 and "outside MLX" in text.output and "blas" in text.output
    from justfit.blas import active_blas
    assert report["blas"] == active_blas() and f"  blas: {active_blas()}" in text.output  # the kernels named


def test_bench_plan_breakdown_checks_the_parts_against_rss(tiny_gguf):
    from bench.plan import breakdown_table, breakdown_worker, check_breakdown

    row = breakdown_worker(str(tiny_gguf), 4, 64)
    for b in (row["load"], row["after_request"]):
        assert b["measured_sum"] + b["parts"]["unaccounted"] == b["rss"]
        assert b["gap"] == abs(b["rss"] - b["measured_sum"]) / b["rss"] and b["within"] == (b["gap"] <= TOLERANCE)
    assert row["within"] and row["after_request"]["parts"]["pages"] + row["after_request"]["parts"]["hot_window"] > 0
    text = "\n".join(breakdown_table(row))
    assert "measured sum" in text and "RSS" in text and "within 5% of RSS" in text
    far = {"parts": {"weights": 90, "unaccounted": 10}, "rss": 100, "outside_mlx": 0, "peaks": {}}
    assert check_breakdown(far)["gap"] == pytest.approx(0.1) and not check_breakdown(far)["within"]
    assert check_breakdown(far, tolerance=0.1)["within"]


def test_measured_counts_no_mlx_buffer_its_cache_keeps():
    """Freed MLX buffers its cache keeps are MLX's, not the step's: a process that ran MLX
    before the engine loads (a test, an embedding caller) would otherwise count its cache
    as interpreter and modules."""
    previous = mx.set_cache_limit(1 << 30)
    try:
        def mlx_step():
            mx.eval(mx.ones((32 << 20) // 4))  # written, then freed into MLX's cache
        _, size = measured(mlx_step)
        assert mx.get_cache_memory() >= 32 << 20
        assert size < 4 << 20
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()

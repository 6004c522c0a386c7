"""The capacity bench's baselines and claims: stock systems run float16 as their users
do, headline ratios only from rows of equal fidelity, fitted memory models, llama.cpp
rows when its binaries are absent."""

import importlib

import pytest


@pytest.mark.parametrize("system", ["mlx-lm", "mlx-lm-tuned"])
def test_stock_systems_hold_a_float16_kv_cache(system, tiny_gemma3_dir, monkeypatch):
    """After a forward pass the stock systems' KV (a quantized cache: its scales) is
    float16, never the float32 of JustFit's import, and the row says so."""
    from dataclasses import replace

    from bench.stock import STOCK, make_stock

    # mlx-lm's group of 64 does not divide the tiny model's head_dim of 32
    monkeypatch.setitem(STOCK, "mlx-lm-tuned", replace(STOCK["mlx-lm-tuned"], kv_group_size=32))
    generate = importlib.import_module("mlx_lm.generate")  # the kv systems patch it for their process
    monkeypatch.setattr(generate, "maybe_quantize_kv_cache", generate.maybe_quantize_kv_cache)
    loaded, step, details = make_stock(system, str(tiny_gemma3_dir))
    assert len(step([1, 2, 3, 4, 5, 6, 7, 8], 3)) == 3
    facts = details()
    assert facts["kv_dtype"] == "float16" and facts["weights_dtype"].startswith("float16")
    assert facts["prefill_step"] == (2048 if system == "mlx-lm" else 512)
    assert facts["kv_bits"] == (None if system == "mlx-lm" else 8)
    # sliding-window layers stay float16 RotatingKVCache (mlx-lm cannot quantize them)
    assert ("QuantizedKVCache" in facts["kv_cache"]) == (system != "mlx-lm")
    assert "RotatingKVCache" in facts["kv_cache"]


def _row(system, budget, positions, **kw):
    return {"system": system, "budget_mib": budget, "positions": positions, "peak_mib": budget - 1,
            "ended_by": "budget", **kw}


def test_headline_ratios_use_only_rows_at_top1_99_and_mark_past_the_trained_context():
    from bench.capacity_report import capacity_markdown
    from bench.fidelity import mark
    from bench.sweep import headline

    rows = [_row("mlx-lm", 400, 1000, trained_context=8192), _row("mlx-lm-tuned", 400, 2000),
            _row("justfit-default", 400, 40000, trained_context=8192, fidelity={"spec": "q8c@0.4", "top1": 0.936}),
            _row("justfit-lossless", 400, 6000, trained_context=8192, fidelity={"spec": "q8c", "top1": 0.998}),
            _row("justfit-retention", 400, 90000, trained_context=8192, fidelity={"spec": "q8c", "top1": 0.998}),
            _row("justfit-compact", 400, 9000, trained_context=8192),  # fidelity not measured
            _row("justfit-lossless@2", 400, 20000, fidelity={"spec": "q8c", "top1": 0.998}),  # 2 x 400 MiB
            _row("mlx-lm", 800, 3000), _row("justfit-lossless", 800, 12000, trained_context=8192, limited=True,
                                            fidelity={"spec": "q8c", "top1": 0.995})]
    for r in rows:
        mark(r)
    by = {(r["system"], r["budget_mib"]): r for r in rows}
    assert by["justfit-default", 400]["headline"] == "top-1 93.60% < 99%"
    assert by["justfit-retention", 400]["headline"] == "evicts positions"
    assert by["justfit-compact", 400]["headline"] == "fidelity not measured"
    assert by["justfit-lossless@2", 400]["headline"] == "budget per rank (2 processes)"
    assert by["justfit-default", 400]["past_trained_context"] and not by["justfit-lossless", 400]["past_trained_context"]
    assert by["justfit-lossless", 800]["past_trained_context"]
    other = _row("justfit-compact", 400, 50000, fidelity={"spec": "q8c@0.5", "top1": 0.999, "mix_distance": 0.4,
                                                         "measured_mix": {"q4c": 1}})
    mark(other)
    assert other["headline"].startswith("fidelity measured on another mix")  # never a headline
    small, large = headline(rows + [other])
    assert small["justfit"] == "justfit-lossless" and small["positions"] == 6000  # not 40,000 nor 90,000
    assert small["mlx-lm"] == "6.00x" and small["mlx-lm-tuned"] == "3.00x" and small["llama.cpp-q8_0"] == ""
    assert large["mlx-lm"] == ">= 4.00x"
    md = capacity_markdown({"machine": {}, "settings": {"model": "m", "budget": "400,800MiB", "step": 1, "out": 1,
                                                         "budgets": ["400MiB", "800MiB"]},
                            "systems": rows, "headline": [small, large]})
    assert "top-1 93.60% < 99%; past trained context 8,192" in md and "| 400 | justfit-lossless | 6,000 | 6.00x" in md


def test_memory_model_fitted_to_measured_points_predicts_them_and_the_budget():
    from bench.memmodel import fit, kv_bytes_per_position, transient_terms

    kv = kv_bytes_per_position(30, 3, 64, 2)  # SmolLM2, float16
    assert kv == 23040 and kv_bytes_per_position(30, 3, 64, 2, bits=8) == 30 * 2 * 3 * 64 * (1 + 4 / 64)
    per, fixed = transient_terms(9, 576, 1536, 49152, 512, 2, 2.18)
    truth = lambda p: 150 * 2**20 + 7 * 2**20 + fixed + p * (kv + per)  # noqa: E731  (baseline holds the weights)
    points = [(p, int(truth(p))) for p in (2304, 4608, 6912, 9216)]
    model = fit(points, 150 * 2**20, 90 * 2**20, kv, (per, fixed))
    assert model.error < 1024 and model.transient_per_position == per  # the measured term, never refitted
    assert abs(model.constant - 7 * 2**20) < 1024
    budget = 1600 * 2**20
    assert abs(model.capacity(budget) - (budget - truth(0)) / (kv + per)) <= 1
    # a short run's allocator growth is not taken for the KV's: it shows as the model's error
    noisy = [(160, int(truth(160))), (320, int(truth(320)) + 15 * 2**20)]
    assert fit(noisy, 150 * 2**20, 90 * 2**20, kv, (per, fixed)).error > 7 * 2**20


def test_llama_cpp_rows_are_errors_when_its_binaries_are_absent(tmp_path):
    from argparse import Namespace

    from bench.capacity import sweep

    args = Namespace(model="smollm2", step=256, out=16, max_positions=1024, max_seconds=10, refine=True,
                     llama_cpp=str(tmp_path), llama_validate="4096", repeats=3, json=True)
    rows = sweep("llama.cpp-q8_0", args, [400 * 2**20, 800 * 2**20])
    assert [r["budget_mib"] for r in rows] == [400, 800]
    assert all("no llama-completion" in r["error"] and "positions" not in r for r in rows)
    assert all("no llama-bench" in r["validation"][0]["error"] for r in rows)


def test_fidelity_of_a_rows_format_mix_is_measured_against_float16_pages(tiny_gemma3_dir, tmp_path, monkeypatch):
    from bench.fidelity import attach, mix_spec

    monkeypatch.setenv("JUSTFIT_BENCH_RESULTS", str(tmp_path))  # the quality run's files go here
    from kvexec import get_format

    q8c, q4c = (get_format(f).bytes_per_token(1, 64) for f in ("q8c", "q4c"))
    assert mix_spec({"q8c": 1.0}, "q8c", 64) == "q8c"
    assert mix_spec({"q8c": 0.5, "q4c": 0.5}, "q8c", 64) == f"q8c@{(q8c + q4c) / 2 / q8c:.3f}"
    # calibrated pages: the suite calibrates the same per-layer mix for the model
    assert mix_spec({"k6a128v5r64": 0.7, "k5a128v5r64": 0.3}, "calibrated", 64) == "calibrated"
    rows = [{"system": "justfit-default", "positions": 5000, "kv_format": "q8c", "head_dim": 32,
             "kv_formats": {"q8c": 0.5, "q4c": 0.5}},
            {"system": "justfit-lossless", "positions": 3000, "kv_format": "q8c", "head_dim": 32,
             "kv_formats": {"q8c": 1.0}}, {"system": "mlx-lm", "positions": 1000}]
    attach(rows, str(tiny_gemma3_dir), 1024)  # pages begin past sinks + hot window + a page
    mixed, lossless, stock = rows
    assert "fidelity" not in stock and lossless["fidelity"]["spec"] == "q8c"
    for r in (mixed, lossless):
        f = r["fidelity"]
        assert 0 <= f["top1"] <= 1 and f["kl"] >= 0 and f["reference"] == "fp16 pages" and f["tokens"] == 1024
    assert mixed["fidelity"]["spec"].startswith("q8c@") and mixed["fidelity"]["measured_mix"]
    assert 0 <= mixed["fidelity"]["mix_distance"] <= 1
    assert any(p.name.startswith("quality-") for p in tmp_path.iterdir())


def test_mlx_lm_dense_holds_the_same_weights_dequantized(tiny_gemma3_dir):
    """mlx-lm-dense (speed only): every quantized matrix dequantized, giving the
    quantized model's logits; the stock systems keep the packed matrices."""
    import mlx.core as mx
    import mlx.nn as nn

    from bench.stock import dequantize, weights_dtype
    from justfit.model.models import load

    model = load(str(tiny_gemma3_dir)).model
    nn.quantize(model, group_size=32, bits=4)  # the tiny import is dense: pack it as a 4-bit model would be
    assert "uint32" in weights_dtype(model)
    x = mx.array([[1, 2, 3, 4, 5]])
    packed = model(x)
    dequantize(model)
    assert weights_dtype(model) == "float32"
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert mx.allclose(model(x), packed, atol=1e-4).item()


def test_a_short_step_stock_run_is_modeled_at_the_sweeps_step_and_checked_where_both_ran():
    """Float16 mlx-lm is measured in short steps here; its capacity is stated for the
    sweep's 2,048-token steps (a larger chunk transient), and the same procedure on
    mlx-lm-fp32 is checked against a run that measured those steps."""
    from bench.capacity_model import _terms, check, model_row
    from bench.memmodel import kv_bytes_per_position
    from bench.stock import STOCK

    shape = {"full_layers": 30, "kv_heads_x_head_dim": 192, "heads": 9, "hidden": 576, "intermediate": 1536,
             "vocab": 49152}
    setup = {"shape": shape, "baseline_rss": 250 * 2**20, "weights_bytes": 100 * 2**20}

    def run(system: str, step: int, sizes) -> dict:
        stock = STOCK[system]
        kv = kv_bytes_per_position(30, 192, 1, 4 if stock.dtype == "float32" else 2, stock.kv_bits)
        per, fixed = _terms(stock, shape, min(stock.prefill_step, step))
        truth = lambda p: setup["baseline_rss"] + 5 * 2**20 + fixed + p * (kv + per)  # noqa: E731
        return {"setup": setup, "steps": [{"positions": p, "peak_rss": int(truth(p))} for p in sizes]}

    short = run("mlx-lm", 128, (160, 320))
    row = {"system": "mlx-lm", "positions": 320}
    model_row(row, short, 1600 * 2**20, 128, 2048)
    assert row["modeled"] and row["modeled_step_tokens"] == 2048 and row["measured_step_tokens"] == 128
    at_2048 = run("mlx-lm", 2048, (2080,))["steps"][0]["peak_rss"]
    per, fixed = _terms(STOCK["mlx-lm"], shape, 2048)
    expected = (1600 * 2**20 - (at_2048 - 2080 * (23040 + per))) // (23040 + per)
    assert abs(row["modeled_positions"] - expected) <= 1  # the 2,048-token chunk, not the 128 it was measured in
    from bench.report import _remodel  # combining saved runs fits the models again from their steps

    saved = {**row, **setup, "steps": short["steps"], "budget_mib": 1600.0, "step_tokens": 2048,
             "modeled_positions": 1, "ended_by": "time limit"}
    _remodel(saved)
    assert saved["modeled_positions"] == row["modeled_positions"]
    checked = check("mlx-lm-fp32", run("mlx-lm-fp32", 128, (160, 320, 480)),
                    run("mlx-lm-fp32", 2048, (2080, 4160, 6240)), 128, 2048, [400 * 2**20, 1600 * 2**20])
    assert checked["max_error_mib"] <= 0.1 and len(checked["points"]) == 3
    small, large = checked["capacities"]
    assert small["measured"] == 0 and large["measured"] == 6240 and large["measured_is"].startswith("at least")
    assert large["modeled"] >= 6240
    from bench.capacity_report import capacity_markdown

    md = capacity_markdown({"machine": {}, "settings": {"model": "m", "budget": "1600MiB", "step": 2048, "out": 32},
                            "systems": [{**row, "budget_mib": 1600.0, "peak_mib": 300, "ended_by": "time limit",
                                         "model_check": checked}]})
    assert "| mlx-lm | 1600 | 128 | 2048 |" in md and "The modeling checked: mlx-lm-fp32" in md


def test_a_justfit_run_stopped_by_its_clock_is_modeled_from_the_planners_page_bytes():
    """JustFit's transient does not grow with the positions: its model is baseline +
    the planner's page bytes per position (the slope of its planned peaks at one chunk)
    + a fitted constant; checked on a run that reached its budget."""
    from bench.capacity_model import check_justfit, model_row
    from bench.report import _remodel

    page, base = 13000, 210 * 2**20

    def step(p: int, chunk: int = 512, extra: int = 0) -> dict:
        return {"positions": p, "prefill_chunk": chunk, "planned": 290 * 2**20 + p * page,
                "peak_rss": base + 140 * 2**20 + p * page + extra}

    # the first step ran at another chunk: the slope is taken at the last step's chunk only
    steps = [step(2080, 256, 9 * 2**20), step(4160), step(6240), step(8320)]
    run = {"setup": {"baseline_rss": base}, "steps": steps}
    row = {"system": "justfit-lossless", "positions": 8320, "ended_by": "time limit"}
    model_row(row, run, 1100 * 2**20, 2048, 2048)
    expected = (1100 * 2**20 - base - 140 * 2**20) // page
    assert row["modeled"] and abs(row["modeled_positions"] - expected) <= 1
    assert row["memory_model"]["kv_bytes_per_position"] == page and row["memory_model"]["error_mib"] == 0
    saved = {**row, "baseline_rss": base, "steps": steps, "budget_mib": 1100.0, "step_tokens": 2048,
             "modeled_positions": 1}
    _remodel(saved)  # combining saved runs models JustFit's clock-stopped rows too
    assert saved["modeled_positions"] == row["modeled_positions"]
    lone = {"system": "justfit-lossless", "positions": 2080}
    model_row(lone, {"setup": {"baseline_rss": base}, "steps": steps[:1]}, 1100 * 2**20, 2048, 2048)
    assert "modeled" not in lone  # one step fits no model: the lower bound stands alone
    flat = {"system": "justfit-retention", "positions": 8320}  # evicting: its plan does not grow
    model_row(flat, {"setup": {"baseline_rss": base}, "steps": [{**s, "planned": 1} for s in steps]},
              1100 * 2**20, 2048, 2048)
    assert "modeled" not in flat
    checked = check_justfit(run, 400 * 2**20, 3)
    assert checked["measured"] == 2080 and checked["fitted_up_to"] == 6240
    assert checked["modeled"] == (400 * 2**20 - base - 140 * 2**20) // page


def test_a_row_run_several_times_counts_its_fewest_positions_in_ratios():
    from bench.sweep import held, ratio

    jf = {"system": "justfit-lossless", "positions": 7680, "min_positions": 6816, "max_positions": 7680}
    assert held(jf) == (6816, "measured") and ratio(jf, {"positions": 3408}) == "2.00x"


def test_peaks_are_each_process_s_own_not_the_harness_s(tmp_path):
    """Linux counts into a child's ru_maxrss the peak of the process it was forked from:
    a harness that once held 300 MiB would make every worker and llama.cpp run report
    at least that. The workers' peak (VmHWM) and bench.llamacpp.peak_rss (a launcher
    between) report the process's own; a timeout stops the command."""
    import subprocess
    import sys
    import time

    import numpy as np

    from bench.llamacpp import peak_rss

    held = np.ones(300 * 2**20 // 8)
    held.sum()  # touched: the harness's peak is now above 300 MiB
    del held
    child = "from justfit.memory import peak_rss_bytes; print(peak_rss_bytes())"
    own = int(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
    assert 0 < own < 250 * 2**20
    grow = "import numpy as np; a = np.ones(80 * 2**20 // 8); a.sum()"
    rss, code, _ = peak_rss([sys.executable, "-c", grow], 60)
    assert code == 0 and 80 * 2**20 < rss < 250 * 2**20
    start = time.monotonic()
    assert peak_rss([sys.executable, "-c", "import time; time.sleep(30)"], 1)[:2] == (0, -9)
    assert time.monotonic() - start < 10
    assert peak_rss([sys.executable, "-c", "raise SystemExit(3)"], 60)[1] == 3

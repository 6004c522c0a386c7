"""The benchmark suites' --quick presets on tiny models: every system reported (an
error row rather than nothing), the output contract, and the files written."""

import json

import pytest


def test_bench_capacity_quick_reports_every_system(tiny_llama_dir, tmp_path, monkeypatch):
    """The --quick capacity run: every system gets a row (positions, or an error when
    nothing fit), each row says how it ran, and JSON, markdown and a PNG plot are written;
    a budget sweep reads every budget, with min and max at the smallest."""
    import bench.common
    from bench.capacity import SYSTEMS
    from bench.capacity import main as capacity

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    args = ["--quick", "--model", str(tiny_llama_dir), "--step", "64", "--out", "8", "--max-positions", "300"]
    result = capacity([*args, "--budget", "4GiB", "--json"])
    rows = {r["system"]: r for r in result["systems"]}
    assert set(rows) == set(SYSTEMS) and result["headline"][0]["budget_mib"] == 4096
    for name in ("mlx-lm-tuned", "mlx-lm-kv4"):  # mlx-lm's 64-value groups do not fit head_dim 16
        assert "divisible" in rows.pop(name)["error"]
    for name in ("llama.cpp", "llama.cpp-q8_0", "llama.cpp-q4_0"):  # no --llama-cpp: an error row, never dropped
        assert "no llama-completion" in rows.pop(name)["error"]
    for r in rows.values():
        assert r["positions"] == 288 and r["limited"] and r["peak_mib"] < 4096  # 4 steps of 64 + 8
        assert r["budget_mib"] == 4096 and r["blas"] and r["prefill_step"] and r["kv_dtype"] and r["weights_dtype"]
        assert r["past_trained_context"] is False and "kv_bits" in r
    assert rows["mlx-lm"]["kv_dtype"] == "float16" and rows["mlx-lm"]["weights_dtype"].startswith("float16")
    # each worker's own BLAS: stock mlx-lm runs the wheel's, as its users do
    assert "reference BLAS" in rows["mlx-lm"]["blas"] and "OpenBLAS" in rows["justfit-default"]["blas"]
    assert rows["justfit-lossless"]["pressure"] == [] and rows["justfit-default"]["pressure"]
    assert "hot window float16" in rows["justfit-default"]["kv_dtype"] and "modeled" not in rows["mlx-lm"]
    assert rows["justfit-default"]["headline"] == "fidelity not measured"  # --quick measures none
    swept = capacity([*args, "--budgets", "20MiB,4GiB", "--systems", "mlx-lm,justfit-lossless", "--repeats", "2",
                      "--json"])
    got = {(r["system"], r["budget_mib"]): r for r in swept["systems"]}
    assert set(got) == {(s, b) for s in ("mlx-lm", "justfit-lossless") for b in (20, 4096)}
    for s in ("mlx-lm", "justfit-lossless"):  # nothing fits 20 MiB: reported, not dropped
        assert "error" in got[s, 20] and "positions" not in got[s, 20] and got[s, 20]["repeat_positions"] == [None] * 2
        assert got[s, 4096]["positions"] == 288
    assert swept["settings"]["budgets"] == ["20MiB", "4GiB"] and len(swept["headline"]) == 2
    names = sorted(p.suffix for p in tmp_path.iterdir())
    assert names.count(".json") == 2 and ".md" in names and ".png" in names
    md = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".md"]
    assert any("justfit-default" in t and "no llama-completion" in t for t in md)
    assert any("## Budget 20 MiB" in t and "## Budget 4096 MiB" in t for t in md)


def test_capacity_ratio_says_how_far_limited_runs_bound_it():
    """A run stopped by the clock holds at least its figure: ratios against it are
    bounds, and between two such runs nothing is claimed."""
    from bench.report import capacity_markdown, capacity_ratio

    stock, kv4 = {"system": "mlx-lm", "positions": 2000}, {"system": "mlx-lm-tuned", "positions": 4000, "limited": True}
    exact, least = {"positions": 8000}, {"positions": 12000, "limited": True}
    assert capacity_ratio(stock, stock) == "1.00x" and capacity_ratio(kv4, kv4) == "1.00x"
    assert capacity_ratio(exact, stock) == "4.00x"
    assert capacity_ratio(least, stock) == ">= 6.00x"
    assert capacity_ratio(exact, kv4) == "<= 2.00x"
    assert capacity_ratio(least, kv4) == "unknown (both limited)"
    assert capacity_ratio(exact, None) == "" and capacity_ratio({"error": "x"}, stock) == ""
    rows = [stock, kv4, {"system": "justfit-default", "peak_mib": 500, "ended_by": "time limit", **least}]
    for r in rows:
        r.setdefault("peak_mib", 400), r.setdefault("ended_by", "budget")
    md = capacity_markdown({"settings": {"model": "m", "budget": "1GiB", "step": 1, "out": 1}, "machine": {},
                            "systems": rows})
    assert "| >= 6.00x | unknown (both limited) |" in md
    modeled = {"system": "mlx-lm", "positions": 2000, "modeled_positions": 3000, "limited": True}
    assert capacity_ratio(exact, modeled) == "2.67x (modeled)"


def test_capacity_runs_made_apart_combine_only_when_comparable(tmp_path):
    import json

    from bench.report import capacity_markdown, combine_capacity

    machine = {"cpu": "x86_64", "cores": 2, "memory_gib": 24, "mlx": "0.3", "date": "d1"}
    settings = {"model": "m", "budget": "1GiB", "step": 2048, "out": 64, "refine": False, "max_positions": 100}
    first = {"machine": machine, "settings": settings, "systems": [
        {"system": "mlx-lm", "budget_mib": 1024.0, "positions": 1000, "peak_mib": 900, "ended_by": "budget"},
        {"system": "justfit-default", "budget_mib": 1024.0, "positions": 5000, "peak_mib": 800,
         "ended_by": "position limit", "limited": True}]}
    again = {"machine": {**machine, "date": "d2"}, "settings": {**settings, "max_positions": 200}, "systems": [
        {"system": "justfit-default", "budget_mib": 1024.0, "positions": 12000, "peak_mib": 850,
         "ended_by": "position limit", "limited": True}]}
    paths = []
    for i, r in enumerate((first, again)):
        paths.append(tmp_path / f"capacity-{i}.json")
        paths[-1].write_text(json.dumps(r))
    both = combine_capacity(paths)
    rows = {r["system"]: r for r in both["systems"]}
    assert rows["justfit-default"]["positions"] == 12000 and rows["justfit-default"]["source"] == "capacity-1.json"
    assert rows["mlx-lm"]["source"] == "capacity-0.json" and both["settings"]["combined_from"] == \
        ["capacity-0.json", "capacity-1.json"]
    assert "| >= 12.00x |" in capacity_markdown(both)
    # a budget run apart joins the sweep as rows of its own
    other = {**again, "systems": [{**again["systems"][0], "budget_mib": 2048.0}]}
    paths[1].write_text(json.dumps(other))
    swept = combine_capacity(paths)
    assert swept["settings"]["budgets"] == ["1024MiB", "2048MiB"] and len(swept["systems"]) == 3
    assert [h["budget_mib"] for h in swept["headline"]] == [1024.0, 2048.0]
    # fidelity measured for a mix in one run stands for the same mix in another
    measured = {"spec": "q8c", "top1": 0.998, "kl": 1e-5, "tokens": 8192}
    lossless = {"system": "justfit-lossless", "budget_mib": 1024.0, "positions": 7000, "trained_context": 8192,
                "fidelity": measured}
    paths[0].write_text(json.dumps({**first, "systems": first["systems"] + [lossless]}))
    paths[1].write_text(json.dumps({**other, "systems": [{**lossless, "budget_mib": 2048.0, "positions": 9000,
                                                          "fidelity": {"spec": "q8c", "error": "not measured"}}]}))
    shared = {(r["system"], r["budget_mib"]): r for r in combine_capacity(paths)["systems"]}
    assert shared["justfit-lossless", 2048.0]["fidelity"]["top1"] == 0.998
    assert shared["justfit-lossless", 2048.0]["headline"] == "eligible"
    assert shared["justfit-lossless", 2048.0]["past_trained_context"]
    paths[1].write_text(json.dumps({**again, "settings": {**settings, "step": 1024}}))
    with pytest.raises(ValueError, match="step"):
        combine_capacity(paths)


def test_bench_speed_quick_follows_the_output_contract(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    import json

    import bench.common
    from bench.speed import main as speed

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    speed(["--quick", "--model", str(tiny_llama_dir), "--json", "--llama-cpp", str(tmp_path / "no-such-binary")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["system"]: r for r in out["systems"]}
    assert set(rows) == {"justfit-nodraft", "mlx-lm", "llama.cpp", "llama.cpp-q8_0", "llama.cpp-q4_0"} and "machine" in out
    for name in ("justfit-nodraft", "mlx-lm"):
        r = rows[name]
        assert r["context"] == 256 and r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["ttft_s"] > 0
        assert r["blas"] and r["weights_dtype"] and r["kv_dtype"] and r["prefill_step"]
    assert rows["mlx-lm"]["kv_dtype"] == "float16" and "reference BLAS" in rows["mlx-lm"]["blas"]
    # the CLI's default pages: each layer's calibrated format, summarized
    assert rows["justfit-nodraft"]["kv_dtype"].endswith(" pages") and " x" in rows["justfit-nodraft"]["kv_dtype"]
    assert rows["justfit-nodraft"]["drafts"] == "none"  # the row set against llama-bench: one token a step
    # decode against the memory floor: bytes read per token over the measured bandwidth
    assert len(out["read_bandwidth_gbs"]) == 2 and min(out["read_bandwidth_gbs"]) > 0
    for name in ("justfit-nodraft", "mlx-lm"):
        r = rows[name]
        assert r["read_mib_per_token"] > 0 and r["floor_tps"] > 0
        floor = max(out["read_bandwidth_gbs"]) * 1e9 / r["read_bytes"]
        assert abs(r["floor_tps"] - floor) <= 0.01 * floor + 0.1
        assert abs(r["floor_fraction"] - r["decode_tps"] / r["floor_tps"]) <= 0.01 * r["floor_fraction"] + 0.002
    for name in ("llama.cpp", "llama.cpp-q8_0", "llama.cpp-q4_0"):  # a failure is a row, never dropped
        assert "llama-bench failed" in rows[name]["error"]
    md = next(p for p in tmp_path.iterdir() if p.suffix == ".md").read_text()
    assert "| justfit-nodraft | 256 | none |" in md


def test_bench_sessions_four_sessions_share_a_budget(tiny_llama_dir):
    from bench.sessions import run

    row = run(str(tiny_llama_dir), 160, None, 48, 4, True, sessions=4, batched=True)
    batched = row.pop("batched")  # the same turns at once through the batch, the same budget
    assert batched["turns"] == len(row["turns"]) and batched["retained"] == row["retained"]
    assert batched["turns_identical_to_round_robin"] == f"{len(row['turns'])}/{len(row['turns'])}"
    # One session's budget: turns wait for each other and swap between turns, as round-robin.
    assert batched["aggregate_decode_tps"] > 0 and batched["restores_from_disk"] > 0
    assert row["sessions"] == 4 and len(row["retained"]) == 4
    assert row["aggregate"] > 3.5 * row["single_session_ceiling"] * 0.9 and not row["both_at_once_fits"]
    assert row["aggregate_decode_tps"] > 0 and row["turns_identical_to_unbudgeted"].split("/")[0] == \
        row["turns_identical_to_unbudgeted"].split("/")[1]
    kept, of = row["identical_where_pages_kept_their_format"].split("/")
    assert kept == of and int(of) == sum(set(t["kv_formats"]) <= {"q8c"} for t in row["turns"]) > 0
    assert all(t["identical"] for t in row["turns"])
    # what is not true by construction: time swapping, swapped-in vs resident TTFT, decode vs alone
    assert 0 < row["swap_share_of_wall"] < 1 and row["swap_out_s"] > 0 and row["turns_swapped_in"] > 0
    assert row["ttft_swapped_in_s"] > 0 and row["alone_decode_tps"] > 0 and row["decode_vs_alone"] > 0


def test_bench_quality_quick_follows_the_output_contract(tiny_gemma3_dir, tmp_path, monkeypatch, capsys):
    import json

    import bench.common
    from bench.quality import main as quality

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    quality(["--quick", "--model", str(tiny_gemma3_dir), "--tokens", "200", "--passkey-lengths", "200",
             "--formats", "q8c,q8c@0.5", "--json"])
    out = json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object
    forced = [r for r in out["systems"] if "top1" in r]
    keys = [r for r in out["systems"] if "passkey_hits" in r]
    assert {r["format"] for r in forced} == {"reference", "q8c", "q8c@0.5"} and all(0 <= r["top1"] <= 1 for r in forced)
    assert all(r["ppl"] > 1 for r in forced) and all(r["passkey_trials"] == 1 for r in keys) and len(keys) == 2
    assert "kv_formats" in next(r for r in forced if r["format"] == "q8c@0.5")
    assert [r["format"] for r in out["systems"] if "error" in r] == ["q8c@0.5"]  # pass-key: teacher-forced only
    assert any(p.suffix == ".md" for p in tmp_path.iterdir())


def test_capacity_kv4_quantizes_what_mlx_lm_can_on_sliding_window_models(tiny_gemma3_dir, monkeypatch):
    import importlib

    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

    from bench.stock import quantize_what_mlx_lm_can
    from justfit.model.models import load

    # the bench's worker replaces mlx-lm's function for its process; here, only for this test
    generate = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(generate, "maybe_quantize_kv_cache", generate.maybe_quantize_kv_cache)
    model = load(str(tiny_gemma3_dir)).model
    cache = make_prompt_cache(model)
    note = quantize_what_mlx_lm_can(cache)
    out = [t for t, _ in generate.generate_step(mx.array([1, 2, 3, 4, 5]), model, prompt_cache=cache,
                                                max_tokens=3, kv_bits=4, kv_group_size=32, quantized_kv_start=0)]
    kinds = [type(c) for c in cache]
    assert len(out) == 3 and RotatingKVCache in kinds  # mlx-lm alone raises "Quantization NYI" here
    assert kinds.count(QuantizedKVCache) + kinds.count(RotatingKVCache) == len(cache)
    assert f"kv4 on {kinds.count(QuantizedKVCache)} of {len(cache)} layers" in note and cache[-1].bits == 4


def test_bench_batch_decode_runs_both_ways_side_by_side(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """bench.batch decode: one row per stream count, alone and batched rates from the
    same run, and the greedy tokens compared between the two ways."""
    import bench.common
    from bench.batch import main as batch

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    result = batch(["decode", "--model", str(tiny_llama_dir), "--streams", "1,3", "--context", "40",
                    "--tokens", "5", "--repeats", "2", "--json"])
    rows = {r["streams"]: r for r in result["systems"]}
    assert set(rows) == {1, 3} and json.loads(capsys.readouterr().out.splitlines()[-1])["systems"]
    for r in rows.values():
        assert len(r["alone_tps"]) == len(r["batched_tps"]) == 2 and min(r["alone_tps"] + r["batched_tps"]) > 0
        assert r["greedy_identical"] and r["repeats_differing"] == 0 and r["ratio_median"] > 0
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


def test_capacity_runs_from_machines_of_one_kind_combine_and_others_do_not(tmp_path):
    import json

    from bench.report import combine_capacity

    machine = {"cpu": "x86_64", "cores": 2, "memory_gib": 23.6, "mlx": "0.3"}
    run = {"settings": {"model": "m", "budget": "1GiB", "step": 8, "out": 1}, "systems": [
        {"system": "mlx-lm", "budget_mib": 1024.0, "positions": 10, "ended_by": "budget"}]}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps({**run, "machine": machine}))
    paths[1].write_text(json.dumps({**run, "machine": {**machine, "memory_gib": 23.5}}))  # a fresh VM, same kind
    assert set(combine_capacity(paths)["settings"]["machines"]) == {"a.json", "b.json"}
    paths[1].write_text(json.dumps({**run, "machine": {**machine, "memory_gib": 16.0}}))
    with pytest.raises(ValueError, match="memory_gib"):
        combine_capacity(paths)


def test_bench_kv_decode_runs_each_row_in_its_own_process(monkeypatch, capsys):
    """bench.kv decode: one worker process per row (a row's place in one process biased
    its speed), a failed row kept with its error; a worker times real SmolLM2 decode."""
    import bench.common
    from bench.kv import decode, main

    calls = []

    def worker(module, args, timeout, ranks=1):
        calls.append((module, args))
        return {"error": "exit 1: boom"} if args[0] == "q4" else {"system": args[0], "decode_tps": 1.0}

    monkeypatch.setattr(bench.common, "run_worker", worker)
    rows = decode(512, ["q8c", "q4"], 2)
    assert [a[0] for _, a in calls] == ["mlx-lm", "justfit-mlx-lm-kv", "q8c", "q4"]
    assert {m for m, _ in calls} == {"bench.kv"} and calls[2][1] == ["q8c", "512", "2", "auto"]
    assert rows[-1] == {"system": "q4", "context": 512, "error": "exit 1: boom"}
    capsys.readouterr()
    main(["--worker", "q8c", "300", "2", "auto"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["system"] == "justfit-q8c" and row["context"] == 300 and row["decode_tps"] > 0 and row["kv_mib"] > 0


def test_the_machine_line_names_the_workers_blas_where_the_harness_has_another():
    from bench.common import machine_line

    same = {"blas": "OpenBLAS (/usr/lib/x/libopenblas.so.0)", "worker_blas": "OpenBLAS (/usr/lib/x/libopenblas.so.0)"}
    assert "BLAS OpenBLAS (/usr/lib/x/libopenblas.so.0), commit" in machine_line(same)
    harness = {**same, "blas": "reference BLAS bundled with mlx[cpu]"}
    line = machine_line(harness)
    assert "OpenBLAS (/usr/lib/x/libopenblas.so.0) in fresh (worker) processes" in line
    assert "reference BLAS bundled with mlx[cpu] in the harness" in line
    assert "BLAS reference BLAS, commit" in machine_line({"blas": "reference BLAS"})  # results saved before the key


def test_bench_trace_lists_the_functions_one_streamed_request_runs_through(tiny_gemma3_dir, tmp_path, monkeypatch):
    import bench.common
    from bench.trace import main as trace

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    out = trace(["--model", str(tiny_gemma3_dir), "--max-tokens", "3", "--long-lines", "40"])
    modules = set(out["by_module"])
    # from the socket (the listener, the route) to the stored state, through the engine and the mechanisms
    assert {"justfit.server.connections", "justfit.engine.sequence", "kvexec.cache"} <= modules
    assert any(m.startswith("statetrans.") for m in modules)
    lengths = [n for functions in out["by_module"].values() for n in functions.values()]
    assert out["functions"] == len(lengths) == sum(out["by_package"].values()) > 50
    assert out["over_40_lines"] and all(n > 40 for n in out["over_40_lines"].values())
    assert sorted(lengths, reverse=True)[:10] == list(out["longest"].values())
    assert next(tmp_path.glob("trace-*.json")).is_file()


def test_before_after_alternates_the_checkouts_and_compares_medians(tmp_path, monkeypatch):
    import bench.before_after as ba
    import bench.common

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    order, figures = [], {"before": iter([10.0, 30.0, 20.0]), "after": iter([11.0, 22.0, 33.0])}

    def one_round(tree, args):
        name = "after" if tree == ba.ROOT else "before"
        order.append(name)
        return dict.fromkeys(ba.FIGURES, next(figures[name]))

    monkeypatch.setattr(ba, "one_round", one_round)
    ratios = ba.main(["--before", str(tmp_path), "--rounds", "3"])
    assert order == ["before", "after", "after", "before", "before", "after"]  # each goes first in turn
    assert ratios == dict.fromkeys(ba.FIGURES, round(22.0 / 20.0, 4))  # the medians' ratio
    saved = json.loads(next(tmp_path.glob("before-after-*.json")).read_text())
    assert saved["medians"]["before"]["decode_tps"] == 20.0 and len(saved["rounds"]["after"]) == 3


def test_grammar_libraries_forces_a_valid_instance_through_llguidance(tmp_path, monkeypatch):
    """bench.grammar_libraries on SmolLM2 with llguidance alone (xgrammar needs torch,
    which JustFit's environment never holds): the token bytes spell the instance, every
    one of its tokens passes the mask, and the row has every figure; the table shows it."""
    import bench.common
    from bench.grammar_libraries import main

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    result = main(["--models", "smollm2", "--libraries", "llguidance", "--rounds", "1"])
    (row,) = result["rows"]
    assert "error" not in row, row
    assert row["vocab_size"] == 49152 and row["mask_tokens"] > 100
    assert 0 < row["mask_us_median"] <= row["mask_us_p90"] <= row["mask_us_max"]
    assert row["compile_ms_median"] > 0 and row["tokenizer_rss_bytes"] > 0
    saved = json.loads(next(tmp_path.glob("grammar-libraries-*.json")).read_text())
    assert saved["rows"] == result["rows"] and saved["versions"]["llguidance"].startswith("1.")


def test_structured_bench_rounds_on_a_tiny_model(tiny_llama_dir):
    """bench.structured's worker on a tiny random model, one round (its replies run to the
    token limit): the free reply is as long as the constrained one, forced tokens are
    taken and change no reply, and the summary has each figure."""
    from bench.structured import summary, table, worker

    got = worker(str(tiny_llama_dir), 1, max_tokens=300)
    (run,) = got["runs"]
    assert run["free"]["tokens"] == run["constrained"]["tokens"] > 0
    assert run["forced_on"]["forced"] > 0 and run["forced_off"]["forced"] > 0
    assert got["checks"]["same_length"] and got["checks"]["forced_same_reply"]
    row = summary(got)
    assert row["forced_speedup"] > 0 and row["free_tps"] > 0 and row["constrained_tps"] > 0
    assert "| " + str(tiny_llama_dir) in table([row])

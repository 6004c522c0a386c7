"""`bench overhead` on a tiny model: every system measured on both paths, and its
figures add up (host and waiting within the wall time, operations counted)."""

import json


def test_bench_overhead_splits_each_token_and_counts_operations(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    import bench.common
    from bench.overhead import SYSTEMS, main

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    result = main(["--model", str(tiny_llama_dir), "--contexts", "8,40", "--tokens", "6", "--rounds", "1"])
    rows = {(r["system"], r["context"]): r for r in result["systems"]}
    assert set(rows) == {(s, c) for s in SYSTEMS for c in (8, 40)}
    for (system, _), r in rows.items():
        assert "error" not in r, r
        assert r["rounds"] == 1 and r["tokens"] == 6 and r["wall_ms"] > 0
        # the main thread's CPU outside the waits and the wall time inside them fit in the
        # wall time (clock granularity and rounding aside)
        assert r["host_ms"] > 0 and r["blocked_ms"] >= 0 and r["blocked_cpu_ms"] >= 0
        assert r["host_ms"] + r["blocked_ms"] <= r["wall_ms"] * 1.02 + 0.05
        assert abs(r["thread_cpu_ms"] - r["host_ms"] - r["blocked_cpu_ms"]) <= 0.01 * r["thread_cpu_ms"] + 0.01
        assert r["ops"] > 0 and sum(r["top_ops"].values()) <= r["ops"] and r["syncs"] >= 1
        # both dispatch the next step with async_eval (JustFit's decode steps are pipelined)
        # before waiting for this one's token with item
        assert r["async_eval_ms"] > 0
    assert rows["justfit@mlx", 8]["native"] is False and rows["mlx-lm@mlx", 8]["kv"].startswith("mlx-lm KVCache")
    ratios = {(r["path"], r["context"]): r for r in result["host_ratios"]}
    assert set(ratios) == {(p, c) for p in ("native", "mlx") for c in (8, 40)}
    assert all(r["host_over_mlx_lm"] > 0 and r["ops_justfit"] > 0 and r["ops_mlx_lm"] > 0 for r in ratios.values())
    out = capsys.readouterr().out
    assert "| justfit@mlx | 8 |" in out and "host / mlx-lm host" in out
    saved = json.loads(next(tmp_path.glob("overhead-*.json")).read_text())
    assert saved["command"].startswith("python -m bench.overhead") and len(saved["rounds"]["mlx-lm@mlx"]) == 1

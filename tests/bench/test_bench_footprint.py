"""bench.footprint end to end on a tiny GGUF model: a real `justfit serve` subprocess,
one request, its whole-process peak and measured breakdown read; a llama-server that
is not there is an error row, never a dropped one."""

from __future__ import annotations

import json

import bench.common
from bench.footprint import main, table
from tests.helpers.tiny_models import write_llama_gguf


def test_one_request_per_server_with_its_peak_and_breakdown(tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path / "results")
    gguf = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(gguf)
    main(["--model", str(gguf), "--contexts", "40", "--tokens", "4", "--systems", "justfit,llama-server",
          "--llama-cpp", str(tmp_path / "no-llama"), "--timeout", "120"])
    (saved,) = (tmp_path / "results").glob("footprint-*.json")
    result = json.loads(saved.read_text())
    justfit, llama = result["rows"]
    assert "error" not in justfit, justfit
    assert justfit["context"] == 40 and justfit["peak_rss"] >= justfit["rss"] > justfit["loaded"]["rss"] > 0
    parts = justfit["breakdown"]["parts"]
    assert sum(parts.values()) == justfit["breakdown"]["rss"] and parts["weights"] > 0 and parts["pages"] > 0
    assert "error" in llama and llama["system"] == "llama-server"
    assert (tmp_path / "cache" / "calibration").is_dir()  # the server's first load calibrated in the shared cache
    assert "| tiny-llama.gguf, 40 tokens | " in result["table"] and "error" in result["table"]


def test_a_first_load_converts_and_calibrates_in_the_servers_own_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path / "results")
    gguf = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(gguf)
    main(["--model", str(gguf), "--contexts", "40", "--tokens", "4", "--systems", "justfit", "--first-load",
          "--timeout", "120"])
    (saved,) = (tmp_path / "results").glob("footprint-*.json")
    (row,) = json.loads(saved.read_text())["rows"]
    assert "error" not in row and row["first_load"] and row["peak_rss"] >= row["loaded"]["peak_rss"] > 0
    # the bench's own process converted the model to read its tokenizer; the server
    # calibrated its pages in a cache of its own, gone with it
    assert (tmp_path / "cache" / "models").is_dir() and not (tmp_path / "cache" / "calibration").exists()


def test_table_has_a_column_per_system_and_a_row_per_prompt():
    rows = [{"system": "justfit", "model": "m", "context": 8000, "peak_rss": 300 * 2**20},
            {"system": "llama-server-q8_0", "model": "m", "context": 8000, "peak_rss": 250 * 2**20},
            {"system": "justfit", "model": "m", "context": 16000, "error": "boom"},
            {"system": "justfit", "model": "m", "context": 32000, "peak_rss": 320 * 2**20, "first_load": True,
             "loaded": {"peak_rss": 310 * 2**20}}]
    lines = table(rows).splitlines()
    assert lines[0] == "| model, prompt | justfit | llama-server-q8_0 |"
    assert lines[2] == "| m, 8,000 tokens | 300 MiB | 250 MiB |"
    assert lines[3].startswith("| m, 16,000 tokens | error: boom | - |")
    assert lines[4] == "| m, 32,000 tokens | 320 MiB (first load 310) | - |"


def test_a_first_load_under_a_budget_is_refused_or_kept_under_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(gguf)

    def row(budget: str) -> dict:
        monkeypatch.setattr(bench.common, "RESULTS", tmp_path / budget)  # a folder each: one file each
        main(["--model", str(gguf), "--contexts", "40", "--tokens", "4", "--systems", "justfit", "--first-load",
              "--timeout", "120", "--budget", budget])
        (saved,) = (tmp_path / budget).glob("footprint-*.json")
        return json.loads(saved.read_text())["rows"][0]

    refused = row("32MiB")
    assert "32.00 MiB" in refused["refused"] and refused["cache_files"] == 0  # before any work
    kept = row("2GiB")
    assert "error" not in kept and "within the whole-process budget 2.00 GiB" in kept["first_load_predicted"]
    assert kept["cache_files"] > 0 and kept["loaded"]["peak_rss"] <= 2 << 30

"""The resume benchmark against the peers' prompt caches: what each server says it
reused, JustFit's cold / warm / restart turns end to end on a tiny model, and
llama-server's (a tiny GGUF) where its binary is built."""

import asyncio
import os
from pathlib import Path

import pytest

LLAMA_CPP = os.environ.get("JUSTFIT_LLAMA_CPP", "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")

# Recorded replies (trimmed): llama-server's /v1/completions with its timings, JustFit's usage.
LLAMA_REPLY = {"choices": [{"text": " The", "index": 0}], "usage": {"prompt_tokens": 4105},
               "timings": {"cache_n": 4096, "prompt_n": 9, "prompt_ms": 61.2, "predicted_n": 1}}
JUSTFIT_REPLY = {"choices": [{"text": " The", "index": 0}],
                 "usage": {"prompt_tokens": 4105, "prompt_tokens_details": {"cached_tokens": 4096}}}


def test_reused_tokens_read_from_either_servers_reply():
    from bench.resume_peers import reused

    assert reused(LLAMA_REPLY) == 4096 and reused(JUSTFIT_REPLY) == 4096
    assert reused({"choices": []}) is None


def _check(row: dict, context: int) -> None:
    assert "error" not in row, row
    assert row["context"] == context and row["follow_up_tokens"] > 0
    assert min(row["ttft_cold_s"], row["ttft_warm_s"], row["ttft_restart_s"]) > 0
    assert not row["cold_reused_tokens"]  # a fresh server: nothing to reuse
    # the second turn resumed the first turn's prompt (a server may recompute its last token)
    assert row["warm_reused_tokens"] >= context - 1 and row["restart_reused_tokens"] >= context - 1


def test_justfit_resumes_the_second_turn_warm_and_across_a_restart(tiny_llama_dir):
    from bench.resume_peers import measure

    row = asyncio.run(measure("justfit", str(tiny_llama_dir), 300))
    _check(row, 300)
    assert row["warm_speedup"] > 0 and row["restart_speedup"] > 0


def test_llama_server_named_without_binaries_gives_an_error_row(tmp_path):
    from bench.resume_peers import measure

    row = asyncio.run(measure("llama-server", "smollm2", 300, str(tmp_path)))
    assert row["system"] == "llama-server" and "no llama-server" in row["error"]


@pytest.mark.skipif(not (Path(LLAMA_CPP) / "llama-server").is_file(),
                    reason="llama-server not built (set JUSTFIT_LLAMA_CPP)")
def test_llama_server_resumes_from_its_prompt_cache_and_a_restored_slot(tmp_path):
    from bench.resume_peers import measure
    from tests.helpers.tiny_models import write_llama_gguf

    gguf = tmp_path / "tiny.gguf"
    write_llama_gguf(gguf)
    row = asyncio.run(measure("llama-server", str(gguf), 200, LLAMA_CPP))  # within the tiny GGUF's trained 256
    _check(row, 200)
    assert row["slot_saved_tokens"] >= 200 and row["slot_restored_tokens"] == row["slot_saved_tokens"]
    assert 0 < row["slot_restore_s"] < row["ttft_restart_s"]


def test_rounds_combine_into_medians_with_every_round_kept():
    from bench.resume_peers import combine

    rounds = [{"system": "justfit", "ttft_cold_s": c, "ttft_warm_s": w, "ttft_restart_s": 0.5, "load_before": 1.0}
              for c, w in ((10.0, 1.0), (30.0, 0.5), (20.0, 2.0))]
    row = combine(rounds)
    assert row["repeats"] == 3 and row["ttft_cold_s"] == 20.0 and row["ttft_warm_s"] == 1.0
    assert row["ttft_cold_s_rounds"] == [10.0, 30.0, 20.0] and row["warm_speedup"] == 20.0
    assert combine(rounds[:1]) == rounds[0]
    failed = combine([*rounds, {"system": "justfit", "error": "RuntimeError: HTTP 500"}])
    assert failed["error"] == "RuntimeError: HTTP 500" and failed["ttft_cold_s_rounds"] == [10.0, 30.0, 20.0]

"""Fidelity for every system on the same tokens: llama-perplexity's windows in the
quality suite, its --kl-divergence output and logits file read back, mlx-lm's
quantized KV scored like JustFit's pages. The runs of llama.cpp itself are skipped
where its binaries are absent."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

# A recorded `llama-perplexity --kl-divergence` run (SmolLM2, q8_0 KV against f16 KV,
# 4 chunks of 2,048 tokens), its summary cut after the lines the parser reads, and
# three lines of its log at -lv 4.
RECORDED = """
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1       5.2486 ±    0.3983       0.00177 ±    0.00362       0.00570 ±    0.00030     2.543 ±  0.170 %    96.872 ±  0.545 %
   4       8.4687 ±    0.3523       0.00214 ±    0.00225       0.00725 ±    0.00024     2.643 ±  0.136 %    95.919 ±  0.309 %

====== Perplexity statistics ======
Mean PPL(Q)                   :   8.468729 ±   0.352259
Mean PPL(base)                :   8.450666 ±   0.351244
Cor(ln(PPL(Q)), ln(PPL(base))):  99.85%
Mean ln(PPL(Q)/PPL(base))     :   0.002135 ±   0.002245
Mean PPL(Q)/PPL(base)         :   1.002138 ±   0.002250
Mean PPL(Q)-PPL(base)         :   0.018064 ±   0.019019

====== KL divergence statistics ======
Mean    KLD:   0.007249 ±   0.000241
Maximum KLD:   0.484697
Median  KLD:   0.003641
RMS Δp    :  2.643 ± 0.136 %
Same top p: 95.919 ± 0.309 %
"""
RECORDED_LOG = """0.00.104.744 I llama_model_loader: - kv  21:               tokenizer.ggml.add_bos_token bool             = false
0.00.170.062 I llama_context: flash_attn            = enabled
0.00.184.430 I llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 64
0.00.184.444 I llama_kv_cache: attn_rot_v = 1, n_embd_head_k_all = 64
"""

LLAMA_CPP = os.environ.get("JUSTFIT_LLAMA_CPP", "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
needs_llama = pytest.mark.skipif(not (Path(LLAMA_CPP) / "llama-perplexity").is_file(),
                                 reason="llama-perplexity not built (set JUSTFIT_LLAMA_CPP)")


def test_kl_divergence_summary_reads_as_the_quality_rows_fields():
    from bench.peer_fidelity import parse_kl_divergence, parse_log_facts

    got = parse_kl_divergence(RECORDED)
    assert got["top1"] == pytest.approx(0.95919) and got["top1_err"] == pytest.approx(0.00309)
    assert got["kl"] == pytest.approx(0.007249) and got["kl_err"] == pytest.approx(0.000241)
    assert got["ppl"] == pytest.approx(8.468729) and got["ppl_base"] == pytest.approx(8.450666)
    # the ratio's own line, not the log ratio's just above it
    assert got["ppl_delta"] == pytest.approx(0.002138) and got["ppl_delta_err"] == pytest.approx(0.00225)
    assert parse_log_facts(RECORDED_LOG) == {"flash_attention": "enabled", "kv_rotation": "Hadamard",
                                             "adds_bos": False}
    cut = RECORDED[: RECORDED.index("====== KL divergence")]  # a run that died before its KL summary
    with pytest.raises(ValueError, match="no kl"):
        parse_kl_divergence(cut)


def _logits_file(path: Path, n_ctx: int, n_vocab: int, tokens: list[int], magic: bytes = b"_logits_") -> Path:
    n_chunk = len(tokens) // n_ctx
    path.write_bytes(magic + struct.pack("<Iii", n_ctx, n_vocab, n_chunk) + struct.pack(f"<{len(tokens)}i", *tokens)
                     + b"\0" * 64)  # the log-probabilities that follow
    return path


def test_logits_file_header_gives_the_tokens_llama_cpp_evaluated(tmp_path):
    from bench.peer_fidelity import read_logits_header, token_alignment

    tokens = list(range(100, 164))
    assert read_logits_header(_logits_file(tmp_path / "a.kld", 32, 500, tokens)) == (32, 500, 2, tokens)
    with pytest.raises(ValueError, match="not a llama-perplexity logits file"):
        read_logits_header(_logits_file(tmp_path / "b.kld", 32, 500, tokens, magic=b"_garbage"))
    cut = tmp_path / "c.kld"
    cut.write_bytes((tmp_path / "a.kld").read_bytes()[:60])
    with pytest.raises(ValueError, match="cut short"):
        read_logits_header(cut)
    assert token_alignment(tokens, tokens) == {"tokens_match": True, "token_mismatches": 0}
    other = tokens[:10] + [7] + tokens[11:60]
    assert token_alignment(tokens, other) == {"tokens_match": False, "token_mismatches": 1, "first_mismatch": 10,
                                              "token_counts": [64, 60]}


def test_windows_score_llama_perplexitys_positions():
    from bench.scoring import Layout

    ids = list(range(10, 110))
    layout = Layout(96, 32, bos=1)
    windows = layout.windows(ids)
    assert [len(w) for w in windows] == [32, 32, 32]
    assert [w[0] for w in windows] == [1, 1, 1] and windows[1][1:] == ids[33:64]  # BOS in place of each first token
    assert layout.first == 16 and layout.scored == 3 * (32 - 1 - 16)
    assert layout.describe()["scored_positions"] == "16..30 of each window"
    one = Layout(50)
    assert one.windows(ids) == [ids[:50]] and one.scored == 49 and one.first == 0
    with pytest.raises(ValueError, match="only 100 tokens"):
        Layout(128, 64).windows(ids)
    with pytest.raises(ValueError):
        Layout(16, 32)


def _mlx_lm(tiny_llama_dir):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from justfit.model.models import load

    model = load(str(tiny_llama_dir)).model

    def forward(piece, cache):
        logits = model(mx.array(piece)[None], cache=cache)[0].astype(mx.float32)
        mx.eval(logits)
        return np.array(logits)

    return lambda: make_prompt_cache(model), forward


def test_scoring_counts_only_the_scored_positions_however_the_window_is_fed(tiny_llama_dir):
    """Fed in pieces that cut a window anywhere, the same positions are scored and a
    system identical to its reference agrees everywhere with no KL."""
    from bench.scoring import Layout, score

    make, forward = _mlx_lm(tiny_llama_dir)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 250, 200)]
    layout = Layout(192, 64, bos=0)
    whole = score(layout, ids, (make, forward), {"same": (make, forward)}, chunk=64)
    cut = score(layout, ids, (make, forward), {"same": (make, forward)}, chunk=13)
    for t in (*whole.values(), *cut.values()):
        assert t.count == layout.scored == 3 * 31
    assert whole["same"].agree == layout.scored and whole["same"].kl == pytest.approx(0, abs=1e-6)
    assert cut["reference"].nll == pytest.approx(whole["reference"].nll, rel=1e-4)


def test_quality_windows_and_mlx_lm_rows_side_by_side(tiny_gemma3_dir, tmp_path, monkeypatch, capsys):
    """One quality run: JustFit's pages and mlx-lm's 8-bit KV on the same windows, each
    against its own reference; llama.cpp named but absent gives error rows, not none."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    import bench.common
    import bench.peer_fidelity
    from bench.quality import main as quality
    from justfit.model.models import load

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    real = bench.peer_fidelity.mlx_lm_rows
    # the tiny model's head_dim of 32 takes groups of 32, not mlx-lm's 64
    monkeypatch.setattr(bench.peer_fidelity, "mlx_lm_rows", lambda *a, **k: real(*a, group_size=32, **k))
    quality(["--model", str(tiny_gemma3_dir), "--tokens", "256", "--context", "128", "--formats", "q8c",
             "--reference", "fp16", "--llama-cpp", str(tmp_path / "nowhere"), "--llama-cache-types", "f16,q8_0",
             "--mlx-lm-kv", "8", "--mlx-lm-dtype", "float16,float32-dense", "--json"])
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out)["systems"]}
    assert set(rows) == {"reference-fp16", "justfit-q8c", "llama.cpp-f16", "llama.cpp-q8_0", "mlx-lm-float16",
                         "mlx-lm-kv8", "mlx-lm-float32-dense", "mlx-lm-kv8-float32-dense"}
    for name in ("reference-fp16", "justfit-q8c", "mlx-lm-float16", "mlx-lm-kv8", "mlx-lm-kv8-float32-dense"):
        r = rows[name]
        assert (r["context"], r["chunks"], r["scored"]) == (128, 2, 2 * 63), name
        assert 0 <= r["top1"] <= 1 and r["kl"] >= -1e-6 and r["ppl"] > 1
    assert rows["mlx-lm-float16"]["top1"] == 1 and rows["mlx-lm-float16"]["ppl_delta"] == 0
    assert rows["mlx-lm-kv8"]["bits_per_value"] == pytest.approx(8 + 2 * 16 / 32)
    dense = rows["mlx-lm-kv8-float32-dense"]  # float32 scales and biases
    assert dense["bits_per_value"] == pytest.approx(8 + 2 * 32 / 32) and "dequantized" in dense["weights_dtype"]
    layers = make_prompt_cache(load(str(tiny_gemma3_dir)).model)
    full = sum(type(c) is KVCache for c in layers)  # sliding-window layers: mlx-lm cannot quantize them
    assert 0 < full < len(layers)
    assert f"QuantizedKVCache in {full} of {len(layers)} layers" in rows["mlx-lm-kv8"]["kv_cache"]
    assert all("no llama-perplexity" in rows[s]["error"] for s in ("llama.cpp-f16", "llama.cpp-q8_0"))
    assert any(p.suffix == ".md" for p in tmp_path.iterdir())


def test_mlx_lm_past_its_time_limit_is_recorded_as_not_measured(tiny_gemma3_dir):
    from bench.peer_fidelity import mlx_lm_rows
    from bench.quality import text_layout
    from justfit.model.models import load

    layout, ids = text_layout(load(str(tiny_gemma3_dir)).tokenizer, 256, 128)
    rows = mlx_lm_rows(str(tiny_gemma3_dir), layout, ids, group_size=32, limit_s=1e-6, chunk=32)
    assert [r["system"] for r in rows] == ["mlx-lm-float16", "mlx-lm-kv8"]
    assert all(r["error"].startswith("not measured: float16 forward passes ran") for r in rows)


def test_llama_cpp_needs_windows(tmp_path):
    from bench.peer_fidelity import llamacpp_rows
    from bench.scoring import Layout

    rows = llamacpp_rows(str(tmp_path), "smollm2", "text", Layout(64), list(range(64)), ("q8_0",))
    assert rows[0]["system"] == "llama.cpp-q8_0" and "windows only" in rows[0]["error"]


@needs_llama
def test_llama_cpp_scores_the_tokens_justfit_scores():
    """llama-perplexity on SmolLM2's GGUF evaluates exactly JustFit's tokens of the text,
    its quantized V cache with flash attention and the build's Hadamard rotation."""
    from bench.common import long_text
    from bench.peer_fidelity import llamacpp_rows
    from bench.quality import text_layout
    from justfit.model.models import load

    layout, ids = text_layout(load("smollm2").tokenizer, 256, 128)
    [q4] = llamacpp_rows(LLAMA_CPP, "smollm2", long_text()[:20000], layout, ids, ("q4_0",))
    assert "error" not in q4, q4
    assert q4["tokens_match"] and q4["token_mismatches"] == 0 and q4["scored"] == 2 * 63
    assert q4["flash_attention"] == "enabled" and q4["kv_rotation"] == "Hadamard" and not q4["adds_bos"]
    assert 0 < q4["top1"] < 1 and q4["kl"] > 0 and q4["bits_per_value"] == 4.5

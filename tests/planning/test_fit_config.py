"""`justfit fit --config`: plans from a config.json alone. Real configs (as published on
Hugging Face) are checked against mlx-lm's own model definitions (parameter counts,
built lazily: nothing is allocated), and the planner's terms against the offline
models' engine plans."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from justfit.planning.fit_config import _footprint, config_fit_report, format_config_fit, read_config

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936}
GEMMA3_27B = {  # multimodal: the language model's fields under text_config, the rest defaulted
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"}}
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 151936}
CONFIGS = {"llama": LLAMA_31_8B, "qwen3": QWEN3_8B, "gemma3": GEMMA3_27B, "qwen3_next": QWEN3_NEXT_80B}


def mlx_lm_params(config: dict, head_in_checkpoint: bool = True) -> int:
    """Parameters of mlx-lm's model for `config` (the language model), built lazily and
    sanitized as loading a checkpoint does (one without a head ties it, as Gemma's)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {k: v for k, v in tree_flatten(model.parameters()) if head_in_checkpoint or "lm_head" not in k}
    return sum(v.size for k, v in model.sanitize(weights).items() if "vision" not in k)


HEAD_IN_CHECKPOINT = {"llama": True, "qwen3": True, "gemma3": False, "qwen3_next": True}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_match_mlx_lm(name):
    shape = read_config(CONFIGS[name])
    assert shape.params == pytest.approx(mlx_lm_params(CONFIGS[name], HEAD_IN_CHECKPOINT[name]), rel=0.002)


def test_layer_types_windows_and_states():
    llama, qwen3, gemma, nxt = (read_config(c) for c in CONFIGS.values())
    assert llama.kinds == ("full",) * 32 and qwen3.kinds == ("full",) * 36
    assert gemma.kinds.count("full") == 10 and gemma.kinds.count("sliding") == 52 and gemma.window == 1024
    assert gemma.kinds[5] == "full" and gemma.context_limit == 131072 and gemma.head_params == 0  # tied
    assert nxt.kinds.count("linear") == 36 and nxt.kinds[3] == "full" and nxt.state_elems == (3 * 8192, 32 * 128 * 128)
    # Explicit layer_types win over patterns.
    mixed = read_config({**QWEN3_8B, "num_hidden_layers": 2, "sliding_window": 128,
                         "layer_types": ["sliding_attention", "full_attention"]})
    assert mixed.kinds == ("sliding", "full") and mixed.window == 128
    with pytest.raises(ValueError, match="hidden_size"):
        read_config({"model_type": "bert"})


def test_known_figures():
    # Llama 3.1 8B in fp16 KV: 128 KiB per position, the well-known figure.
    r = config_fit_report(LLAMA_31_8B, 4, 24 * 2**30, None)
    assert next(x for x in r["formats"] if x["format"] == "fp16")["bytes_per_position"] == 128 * 1024
    assert r["weights"] == pytest.approx(8.03e9 * (0.5 + 4 / 64), rel=0.01)  # 4 bits + scales and biases
    # Qwen3-Next: only the 12 full-attention layers grow; its 36 linear ones hold a constant state.
    nxt = config_fit_report(QWEN3_NEXT_80B, 4, 64 * 2**30, 200_000)
    assert nxt["formats"][1]["bytes_per_position"] == 12 * 2 * 2 * 256 * 2  # fp16
    # 80B at 4 bits does not fit 24 GiB; with layers streamed from disk it does.
    tight = config_fit_report(QWEN3_NEXT_80B, 4, 24 * 2**30, 32_768)
    assert not tight["plan"]["fits"] and tight["plan"]["fits_offloaded"]


def test_gemma3_27b_on_a_24_gib_mac():
    """The question the feature answers: 200K positions of Gemma 3 27B at 4 bits in 24 GiB."""
    r = config_fit_report(GEMMA3_27B, 4, 24 * 2**30, 200_000)
    plan = r["plan"]
    assert plan["fits"] and plan["beyond_context"]  # fits, with q8c pages stepping down; past 131K trained
    fp = plan["footprint"]
    # Sliding layers stop at their window: 52 layers hold about 1K positions each, not 200K.
    full_only = config_fit_report({**GEMMA3_27B, "text_config": {**GEMMA3_27B["text_config"],
                                                                 "sliding_window_pattern": 1}}, 4, 24 * 2**30, 200_000)
    assert full_only["plan"]["footprint"]["kv"] > 4 * fp["kv"] and not full_only["plan"]["fits"]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_matches_the_offline_models_plans(model, request):
    """The same terms as the planner's for the real model, loaded (lazily, as the engine
    does): KV (pages, windows, hot rows) and transients equal at every size, in every
    KV format; parameters as the loaded model's."""
    from justfit.model.models import load
    from justfit.planning.cost_model import footprint
    from kvexec import KVConfig

    loaded = load(str(request.getfixturevalue(f"{model}_gguf")), lazy=True)
    shape = read_config(loaded.config)
    for kv in (KVConfig(), KVConfig(format="q4c"), None):
        for positions in (1, 700, 4096, 30_000):
            ours = _footprint(shape, positions, 8, kv, 4)
            theirs = footprint(loaded.model, loaded.config, positions, 128, kv, 0, 0, 4, limited=True)
            assert (ours.kv, ours.transient) == (theirs.kv, theirs.transient), (kv, positions)
            assert ours.shape.windows == theirs.shape.windows and ours.shape.full_layers == theirs.shape.full_layers
    tied = loaded.config.get("tie_word_embeddings", model == "gemma3")
    assert shape.params == pytest.approx(mlx_lm_params(loaded.config, not tied), rel=0.002)


def test_cli(tmp_path):
    from cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GEMMA3_27B))
    out = CliRunner().invoke(main, ["fit", "--config", str(tmp_path), "--weights-bits", "4", "--budget", "24GiB",
                                    "--context", "200000"])
    assert out.exit_code == 0, out.output
    assert "27.0" in out.output and "plan for 200,000 positions: fits" in out.output
    data = json.loads(CliRunner().invoke(main, ["fit", "--config", str(cfg), "--budget", "24GiB", "--json"]).output)
    assert data["layers"] == {"full": 10, "sliding": 52, "linear": 0} and data["bits"] == 4
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    out = CliRunner().invoke(main, ["fit", "--config", str(bad)])
    assert out.exit_code == 1 and "error:" in out.output
    out = CliRunner().invoke(main, ["fit", "--config", str(tmp_path / "missing.json")])
    assert out.exit_code == 1 and "cannot read" in out.output


def test_comparison_rows_name_their_kv(smollm2_gguf):
    """mlx-lm's KV at float16 (what its users hold), float32 only with float32
    activations; llama.cpp's f16 and q8_0 from the shapes; SmolLM2: 30 layers, 3 KV
    heads of 64."""
    from justfit.model.models import load

    config = load(str(smollm2_gguf), lazy=True).config
    budget = 800 * 2**20
    half = {r["format"]: r for r in config_fit_report(config, 4, budget)["formats"]}
    assert half["mlx-lm fp16"]["bytes_per_position"] == 30 * 2 * 3 * 64 * 2 == 23_040 and "mlx-lm fp32" not in half
    assert half["llama.cpp f16"]["bytes_per_position"] == 23_040
    assert half["llama.cpp q8_0"]["bytes_per_position"] == 30 * 2 * 3 * 64 * 34 / 32 == 12_240
    full = {r["format"]: r for r in config_fit_report(config, 4, budget, act_bytes=4)["formats"]}
    assert full["mlx-lm fp32"]["bytes_per_position"] == 46_080 and full["mlx-lm fp16"] == half["mlx-lm fp16"]
    assert "mlx-lm" not in half  # a JustFit row of mlx-lm's cache only when planning with it (--kv-format none)
    report = config_fit_report(config, 4, budget)
    for name in ("llama.cpp f16", "llama.cpp q8_0"):  # the most positions whose KV fits beside the weights
        row = half[name]
        assert report["weights"] + row["max_positions"] * row["bytes_per_position"] <= budget
        assert report["weights"] + (row["max_positions"] + 1) * row["bytes_per_position"] > budget
        assert row["max_positions_offloaded"] is None and row["compare"]
    # Gemma 3 27B: llama.cpp's sliding layers stop at their window, as JustFit's do.
    gemma = {r["format"]: r for r in config_fit_report(GEMMA3_27B, 4, 24 * 2**30)["formats"]}["llama.cpp q8_0"]
    assert gemma["bytes_per_position"] == 62 * 2 * 16 * 128 * 34 / 32
    assert gemma["max_positions"] > 4 * (24 * 2**30 - 16 * 2**30) / gemma["bytes_per_position"]
    text = format_config_fit(report)
    assert "compared with:\nmlx-lm fp16" in text and "llama.cpp q8_0      12240" in text
    assert "mlx-lm fp32: only with float32 activations" in text and "trained context 8,192 need" in text

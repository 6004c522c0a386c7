"""Every mlx-lm API JustFit calls, asserted on its signature and behaviour, so a new
mlx-lm release that changes one fails here, by name, before it fails in use. The
pin in pyproject.toml is the range these pass on."""

import importlib
import inspect
import json
import pkgutil
import shutil
import tomllib
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.utils import _get_classes
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0, tie_word_embeddings=True)
GEMMA3 = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, vocab_size=97,
              sliding_window=8, sliding_window_pattern=6, query_pre_attn_scalar=32)
QWEN3_NEXT = dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=97,
                  rope_theta=10000.0, max_position_embeddings=512, linear_num_value_heads=2,
                  linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1,
                  shared_expert_intermediate_size=96, mlp_only_layers=[0, 1, 2, 3], moe_intermediate_size=32,
                  partial_rotary_factor=0.5, full_attention_interval=2)


def _model(config: dict):
    """utils._get_classes -> (Model, ModelArgs); ModelArgs.from_dict (tests' tiny models)."""
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.apply(lambda a: a.astype(mx.float32))
    return model


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_installed_mlx_lm_is_in_the_pinned_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(Requirement(d) for d in deps if Requirement(d).name == "mlx-lm")
    assert pin.specifier.contains(version("mlx-lm")), (pin, version("mlx-lm"))
    assert any(s.operator == "<" for s in pin.specifier), "an upper bound: the range tested here"


# -- models.cache: make_prompt_cache, the cache classes, state / from_state ------------------

def test_make_prompt_cache_gives_one_cache_per_layer_of_each_kind():
    kinds = lambda config: [type(c).__name__ for c in mlx_cache.make_prompt_cache(_model(config))]  # noqa: E731
    assert kinds(LLAMA) == ["KVCache"] * 2
    assert kinds(GEMMA3) == ["RotatingKVCache"] * 5 + ["KVCache"]
    assert kinds(QWEN3_NEXT) == ["ArraysCache", "KVCache"] * 2
    rotating = mlx_cache.make_prompt_cache(_model(GEMMA3))[0]
    assert rotating.max_size == 8  # kvexec.make_cache sizes its windowed pages from it


@pytest.mark.parametrize("config", [LLAMA, GEMMA3, QWEN3_NEXT], ids=["llama", "gemma3", "qwen3_next"])
def test_state_round_trips_through_one_argument_from_state(config):
    # statetrans saves tree_flatten(c.state) (arrays and scalars) and calls cls.from_state(tree).
    model = _model(config)
    cache = mlx_cache.make_prompt_cache(model)
    prompt = mx.array([[int(t) for t in range(3, 3 + 13)]])
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    rebuilt = []
    for c in cache:
        assert _params(type(c).from_state) == ["state"]
        flat = tree_flatten(c.state)
        rebuilt.append(getattr(mlx_cache, type(c).__name__).from_state(tree_unflatten(flat)))
        assert rebuilt[-1].nbytes == c.nbytes and getattr(rebuilt[-1], "offset", 0) == getattr(c, "offset", 0)
    step = mx.array([[7]])
    assert mx.array_equal(model(step, cache=cache), model(step, cache=rebuilt))


def test_quantized_kv_cache_state_round_trips():
    cache = mlx_cache.QuantizedKVCache(group_size=32, bits=4)
    k = mx.random.normal((1, 2, 5, 64))
    cache.update_and_fetch(k, k)
    again = mlx_cache.QuantizedKVCache.from_state(tree_unflatten(tree_flatten(cache.state)))
    assert again.offset == 5 and again.bits == 4 and again.group_size == 32 and again.nbytes == cache.nbytes


def test_cache_trim_protocol():
    c = mlx_cache.make_prompt_cache(_model(LLAMA))[0]
    k = mx.zeros((1, 2, 5, 16))
    c.update_and_fetch(k, k)
    assert c.is_trimmable() and c.trim(2) == 2 and c.offset == 3 and c.size() == 3 and not c.empty()
    assert mlx_cache.can_trim_prompt_cache([c])


def test_base_cache_class_that_paged_cache_follows():
    base = mlx_cache._BaseCache
    assert isinstance(base.state, property) and base.state.fset is not None
    for name in ("is_trimmable", "size", "empty", "nbytes", "from_state"):
        assert hasattr(base, name), name
    assert _params(mlx_cache.create_attention_mask) == ["N", "offset", "return_array", "window_size"]


def test_rotating_cache_cannot_be_quantized():
    # bench's kv4 baselines leave sliding-window layers in float16 for this reason.
    with pytest.raises(NotImplementedError, match="NYI"):
        mlx_cache.RotatingKVCache(max_size=8).to_quantized(bits=4)


# -- models.base: the seam KVExec wraps ---------------------------------------------------

def test_scaled_dot_product_attention_signature_and_module_names():
    from mlx_lm.models import base

    sig = inspect.signature(base.scaled_dot_product_attention)
    assert list(sig.parameters) == ["queries", "keys", "values", "cache", "scale", "mask", "sinks"]
    assert sig.parameters["sinks"].default is None
    # the seam replaces the name in each model's module, so models must look it up there
    for arch in ("llama", "qwen3", "gemma3_text", "qwen3_next"):
        source = inspect.getsource(importlib.import_module(f"mlx_lm.models.{arch}"))
        assert "from .base import" in source and "scaled_dot_product_attention(" in source, arch
        assert "cache=cache" in source, arch


def test_models_ask_their_cache_for_the_mask():
    from mlx_lm.models.base import create_attention_mask

    asked = []

    class Cache:
        offset = 0

        def make_mask(self, N, return_array=False, window_size=None):
            asked.append((N, window_size))
            return None

    assert create_attention_mask(mx.zeros((1, 3, 8)), Cache(), window_size=4) is None
    assert asked == [(3, 4)]


# -- sample_utils -----------------------------------------------------------------------

def test_make_sampler_positional_temp_top_p_min_p_and_top_k():
    from mlx_lm.sample_utils import make_sampler

    assert _params(make_sampler)[:3] == ["temp", "top_p", "min_p"] and "top_k" in _params(make_sampler)
    logprobs = mx.log(mx.array([[0.1, 0.6, 0.3]]))
    assert make_sampler(0.0, 0.0, 0.0, top_k=0)(logprobs).item() == 1
    mx.random.seed(0)
    draws = {make_sampler(1.0, 0.0, 0.0, top_k=2)(logprobs).item() for _ in range(50)}
    assert draws == {1, 2}


def test_make_logits_processors_keywords_and_call():
    from mlx_lm.sample_utils import make_logits_processors

    for kw in ("repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
               "frequency_penalty", "frequency_context_size"):
        assert kw in _params(make_logits_processors), kw
    assert make_logits_processors(repetition_penalty=None, presence_penalty=None, frequency_penalty=None) == []
    procs = make_logits_processors(repetition_penalty=2.0, repetition_context_size=8,
                                   presence_penalty=1.0, presence_context_size=8,
                                   frequency_penalty=1.0, frequency_context_size=8)
    assert len(procs) == 3
    logits = mx.ones((1, 5))
    for p in procs:  # called as (tokens, logits[None]) by justfit.engine.generate.decode
        out = p(mx.array([2, 2]), logits)
        assert out.shape == (1, 5) and out[0, 2].item() < 1.0 and out[0, 0].item() == 1.0


# -- generate ---------------------------------------------------------------------------

def test_generate_step_keywords_and_output():
    from mlx_lm.sample_utils import make_sampler

    generate = importlib.import_module("mlx_lm.generate")  # the package's `generate` is the function

    for kw in ("max_tokens", "sampler", "logits_processors", "prompt_cache", "prefill_step_size", "kv_bits",
               "kv_group_size", "quantized_kv_start"):
        assert kw in _params(generate.generate_step), kw
    # bench replaces it in the module: generate_step must look it up when it starts
    assert "maybe_quantize_kv_cache," in inspect.getsource(generate.generate_step)
    model = _model(LLAMA)
    cache = mlx_cache.make_prompt_cache(model)
    out = list(generate.generate_step(mx.array([1, 2, 3]), model, prompt_cache=cache, max_tokens=3,
                                      sampler=make_sampler(0.0), logits_processors=[lambda t, x: x],
                                      prefill_step_size=2))
    assert len(out) == 3 and all(isinstance(int(t), int) and lp.shape == (97,) for t, lp in out)
    assert cache[0].offset == 3 + 3  # it runs a step ahead: every yielded token is in the cache


# -- utils.load and the tokenizer wrapper ----------------------------------------------

@pytest.fixture(scope="module")
def tool_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compat") / "llama"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tool_parser_type": "json_tools"}))
    return path


def test_load_lazy_with_config(tool_model_dir):
    from mlx_lm.utils import load

    assert {"lazy", "return_config"} <= set(_params(load))
    model, tokenizer, config = load(str(tool_model_dir), return_config=True, lazy=True)
    assert config["model_type"] == "llama" and hasattr(model, "layers")


def test_load_refuses_an_unknown_architecture_saying_not_supported(tool_model_dir, tmp_path):
    # justfit.model.models turns this ValueError into UnsupportedModel by its wording
    from mlx_lm.utils import load

    path = tmp_path / "m"
    shutil.copytree(tool_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    with pytest.raises(ValueError, match="not supported"):
        load(str(path))


def test_tokenizer_wrapper_api(tool_model_dir):
    from mlx_lm.utils import load

    _, tok = load(str(tool_model_dir), lazy=True)
    ids = list(tok.encode("hello world"))
    assert ids and isinstance(tok.eos_token_ids, set) and tok.chat_template
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert isinstance(chat, list) and all(isinstance(t, int) for t in chat)
    # the engine's fallback for base models passes its own template; tools pass through
    own = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  chat_template="{{ messages[0]['content'] }}", tools=[{"type": "function"}])
    assert tok.decode(own) == "hi"
    detok = tok.detokenizer
    detok.reset()
    text = ""
    for t in ids:
        detok.add_token(t)
        text += detok.last_segment
    detok.finalize()
    assert text + detok.last_segment == "hello world"
    # tool calling, as justfit.server.tools reads it
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>" and tok.tool_call_end == "</tool_call>"
    assert tok.tool_parser('{"name": "f", "arguments": {"a": 1}}', None) == {"name": "f", "arguments": {"a": 1}}


def test_every_tool_parser_has_markers_and_a_text_tools_parser():
    import mlx_lm.tool_parsers as parsers

    names = [m.name for m in pkgutil.iter_modules(parsers.__path__)]
    assert {"json_tools", "pythonic", "qwen3_coder", "mistral"} <= set(names)
    for name in names:
        mod = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        assert isinstance(mod.tool_call_start, str) and mod.tool_call_start, name
        assert isinstance(mod.tool_call_end, str), name  # may be "" (mistral): calls run to the end
        params = list(inspect.signature(mod.parse_tool_call).parameters.values())
        assert len(params) == 2 and params[1].default is None, name
    from mlx_lm.tool_parsers import pythonic

    assert pythonic.parse_tool_call('[get_weather(city="Paris")]', None) == \
        {"name": "get_weather", "arguments": {"city": "Paris"}}

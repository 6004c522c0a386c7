"""The model adapter (justfit/model/adapter.py) installs the seam, native operations, native
layers and phase hooks in its order, refuses a model the seam cannot serve with nothing
left installed, and removes all of it: the model's modules run as mlx-lm loaded them.
And the native kernels' switch (justfit.runtime.native_kernels) says why they are off."""

from __future__ import annotations

import logging
import sys

import mlx.core as mx
import pytest
from mlx_lm.models import gemma2, llama

import kvexec
from justfit import runtime
from justfit.model import adapter
from justfit.model.native_layers import NativeLlamaBlock
from kvexec import KVConfig, SeamBypassed, seam
from phaseswap.native import NativeRMSNorm, NativeRoPE
from tests.helpers.tiny_models import in_memory_model

BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=True)


def _model(model_type: str = "llama", **extra):
    return in_memory_model({**BASE, **extra, "model_type": model_type})


def _as_loaded(model) -> list:
    """Each module's path, class and identity, and the attention functions it calls."""
    return ([(path, type(m), id(m), sorted(k for k in m.__dict__ if k.startswith("_native") or k == "_phaseswap"))
             for path, m in model.named_modules()]
            + [llama.scaled_dot_product_attention])


def test_install_then_remove_gives_back_the_model_as_loaded():
    model = _model()
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    loaded, own = _as_loaded(model), model(tokens)  # mlx-lm's own cache and code
    adapted = adapter.install(model, paged=True, native=True, policy="quantized")  # stored weights: none converted
    layer = model.model.layers[0]
    assert seam.wrapped(llama) and adapted.seam == [llama]
    assert type(layer).phaseswap_base is (NativeLlamaBlock if runtime.native_kernels() else llama.TransformerBlock)
    if runtime.native_kernels() is not None:  # native operations under the native layers
        assert type(layer.self_attn.rope) is NativeRoPE and type(layer.input_layernorm) is NativeRMSNorm
    cache = kvexec.make_cache(model, KVConfig(format="fp32", page_size=16, hot_window=8, block_tokens=32))
    paged = model(tokens, cache=cache)  # through the seam to KVExec's executor, natives where they apply
    assert mx.allclose(paged, own, atol=1e-4).item()
    adapter.remove(adapted)
    adapter.remove(adapted)  # once is enough
    assert _as_loaded(model) == loaded
    assert mx.array_equal(model(tokens), own).item()  # bit for bit: nothing of JustFit's left in the path


def test_a_refused_model_keeps_nothing_installed_and_check_leaves_the_seam_as_it_was():
    model = _model("gemma2", query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    was = seam.wrapped(gemma2)
    with pytest.raises(SeamBypassed, match="gemma2"):
        adapter.install(model, paged=True, native=True, policy="quantized")
    assert seam.wrapped(gemma2) == was and all(not hasattr(m, "phaseswap_base") for _, m in model.named_modules())
    fine = _model()
    before = llama.scaled_dot_product_attention
    assert adapter.check(fine) == 2 and llama.scaled_dot_product_attention is before


def test_the_seam_stays_while_another_adapted_model_uses_it():
    first, second = _model(), _model()
    a, b = (adapter.install(m, paged=True, native=False) for m in (first, second))
    adapter.remove(a)
    assert seam.wrapped(llama)  # the second model's paged attention still reaches KVExec
    adapter.remove(b)


def test_native_kernels_say_once_why_they_are_off(monkeypatch, caplog):
    find = runtime.native_kernels.__wrapped__  # the uncached lookup
    caplog.set_level(logging.INFO, logger="justfit.runtime")
    monkeypatch.setenv(runtime.NATIVE_ENV, "0")
    assert find() is None and "off by request" in caplog.text
    assert caplog.records[-1].levelno == logging.INFO
    monkeypatch.delenv(runtime.NATIVE_ENV)
    monkeypatch.setitem(sys.modules, "justfit_native", None)  # not built
    caplog.clear()
    assert find() is None and "not built" in caplog.text and "MLX's own" in caplog.text
    assert caplog.records[-1].levelno == (logging.WARNING if sys.platform.startswith("linux") else logging.INFO)

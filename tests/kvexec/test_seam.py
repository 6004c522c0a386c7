"""KVExec's seam fails loudly: placeholders raise when read by any path but the
executor, and install refuses, by a probe forward, a model whose attention bypasses it."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import _BaseCache

import kvexec
from kvexec import KVConfig, PagedKVCache, SeamBypassed
from kvexec.cache import KVPlaceholder
from kvexec.seam import check
from tests.helpers.tiny_models import in_memory_model

SMALL = dict(page_size=16, hot_window=8, sink_tokens=2, block_tokens=32)
BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=True)
PASSING = {  # model type -> (extra config, attention layers)
    "llama": ({}, 2),
    "qwen3": ({}, 2),
    "gemma3_text": (dict(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         sliding_window=24, sliding_window_pattern=6, query_pre_attn_scalar=32), 6),
    "qwen3_next": (dict(num_hidden_layers=4, linear_num_value_heads=2, linear_num_key_heads=2,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                        num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1,
                        shared_expert_intermediate_size=96, mlp_only_layers=[0, 1, 2, 3],
                        moe_intermediate_size=32, partial_rotary_factor=0.5, full_attention_interval=2), 2),
    "stablelm": (dict(partial_rotary_factor=0.25, layer_norm_eps=1e-5, use_qkv_bias=False), 2),  # casts keys: allowed
}
REFUSED = {  # mlx-lm architectures that compute attention inline
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "plamo": dict(n_shared_head=2),
}


def _tiny(model_type: str, extra: dict):
    return in_memory_model({**BASE, **extra, "model_type": model_type}, float32=False)


def _fetched(window=None):
    cache = PagedKVCache(KVConfig(format="fp32", **SMALL), window)
    k = mx.random.normal((1, 2, 5, 64))
    cache.update_and_fetch(k, k)
    return cache, cache.update_and_fetch(k[:, :, :1], k[:, :, :1])


# -- placeholders -----------------------------------------------------------------------

def test_placeholders_show_shape_and_dtype_of_all_positions():
    cache, (keys, values) = _fetched()
    assert isinstance(keys, KVPlaceholder) and keys.shape == (1, 2, 6, 64) and keys.dtype == mx.float32
    assert values.shape == keys.shape and keys.ndim == 4 and len(keys) == 1
    assert keys.astype(mx.float16).dtype == mx.float16  # a cast reads nothing


@pytest.mark.parametrize("read", [
    lambda k: k.swapaxes(-1, -2), lambda k: k.transpose(0, 1, 3, 2), lambda k: k.reshape(-1), lambda k: k.T,
    lambda k: k[..., :1, :], lambda k: k * 2.0, lambda k: mx.ones((64,)) * k, lambda k: 1.0 + k, lambda k: -k,
    lambda k: mx.array(k), lambda k: np.asarray(k), lambda k: list(k), lambda k: k.tolist(),
], ids=["swapaxes", "transpose", "reshape", "T", "slice", "mul", "rmul-array", "radd", "neg", "mx.array",
        "numpy", "iter", "tolist"])
def test_reading_a_placeholder_raises_a_clear_error(read):
    _, (keys, _) = _fetched()
    with pytest.raises(SeamBypassed, match="only KVExec's attention executor reads"):
        read(keys)


def test_attention_call_given_placeholders_without_their_cache_raises():
    model = _tiny("llama", {})
    kvexec.install(model)
    _, (keys, values) = _fetched()
    q = mx.zeros((1, 4, 1, 64))
    with pytest.raises(SeamBypassed, match="without the cache"):
        llama.scaled_dot_product_attention(q, keys, values, cache=None, scale=1.0, mask=None)


def test_paged_cache_follows_mlx_lm_cache_base_class():
    cache, _ = _fetched()
    assert isinstance(cache, _BaseCache)
    assert cache.size() == cache.offset == 6 and not cache.empty() and cache.is_trimmable() and cache.nbytes > 0
    with pytest.raises(TypeError, match="kvexec.export"):
        PagedKVCache.from_state(cache.state)


# -- the probe at install -----------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(PASSING))
def test_models_calling_the_seam_pass_with_every_attention_layer_counted(model_type):
    extra, layers = PASSING[model_type]
    model = _tiny(model_type, extra)
    kvexec.install(model)
    assert check(model) == layers


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_mlx_lm_models_computing_attention_inline_are_refused_by_name(model_type):
    with pytest.raises(SeamBypassed, match=rf"^{model_type}: its attention .*\(kv=None\)$"):
        kvexec.install(_tiny(model_type, REFUSED[model_type]))


class InlineAttention(llama.Attention):
    """Like mlx-lm's gemma2/olmo: scores computed here, not by scaled_dot_product_attention."""

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in
                   ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads)))
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        reps = self.n_heads // self.n_kv_heads
        scores = mx.softmax((q * self.scale) @ mx.repeat(k, reps, axis=1).swapaxes(-1, -2), axis=-1)
        return self.o_proj((scores @ mx.repeat(v, reps, axis=1)).transpose(0, 2, 1, 3).reshape(B, L, -1))


class CurrentChunkAttention(llama.Attention):
    """Calls the seam, but its keys are this chunk's own: the fetched ones go unread,
    and one layer in two skips the attention call altogether."""

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in
                   ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads)))
        cache.update_and_fetch(k, v)
        if self.skip:
            return self.o_proj(mx.zeros((B, L, self.n_heads * q.shape[-1]), x.dtype))
        out = llama.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


@pytest.mark.parametrize("attention", [InlineAttention, CurrentChunkAttention])
def test_a_model_whose_attention_bypasses_the_seam_is_refused(attention):
    model = _tiny("llama", {})
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.__class__ = attention
        layer.self_attn.skip = i % 2 == 1
    with pytest.raises(SeamBypassed, match=r"^llama: its attention"):
        kvexec.install(model)


def test_probe_builds_graphs_only(tiny_llama_dir):
    from mlx_lm.utils import load

    model, _ = load(str(tiny_llama_dir), lazy=True)
    mx.synchronize()
    before = mx.get_active_memory()
    kvexec.install(model)
    assert mx.get_active_memory() == before  # no weight read, nothing evaluated

"""KVExec: formats, page store, blockwise executor, and the seam into mlx-lm models."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvexec
from kvexec import FORMATS, KVConfig, PageStore, blockwise_attention, get_format
from tests.helpers.tiny_models import in_memory_model

SMALL = dict(page_size=16, hot_window=8, sink_tokens=2, block_tokens=32)


def _reference(q, K, V, window=None, sinks=None):
    L, S = q.shape[2], K.shape[2]
    qpos, kpos = mx.arange(S - L, S)[:, None], mx.arange(S)[None]
    mask = kpos <= qpos
    if window:
        mask = mask & (qpos - kpos < window)
    return mx.fast.scaled_dot_product_attention(q, K, V, scale=q.shape[-1] ** -0.5, mask=mask, sinks=sinks)


def _run(store, chunks, heads, sinks=None, seed=0, rel=False):
    """Feed chunks through a store; the worst max-abs error against reference attention
    (with rel=True: the worst relative RMS error)."""
    rng = np.random.default_rng(seed)
    B, kvh, D = 1, 3, 64
    ks, vs, errs = [], [], []
    for L in chunks:
        k, v = (mx.array(rng.normal(size=(B, kvh, L, D)).astype(np.float32)) for _ in range(2))
        q = mx.array(rng.normal(size=(B, heads, L, D)).astype(np.float32))
        store.append(k, v)
        ks.append(k)
        vs.append(v)
        out = blockwise_attention(q, store.blocks(), store.offset - L, D**-0.5, store.window, sinks)
        ref = _reference(q, mx.concatenate(ks, 2), mx.concatenate(vs, 2), store.window, sinks)
        if rel:
            errs.append(float(mx.sqrt(((out - ref) ** 2).mean() / (ref**2).mean())))
        else:
            errs.append(float(mx.abs(out - ref).max()))
    return max(errs)


CHUNKS = [37, 1, 1, 16, 15, 1, 64, 1, 100, 1]  # odd lengths, exact page boundaries, decode


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads", [3, 9])  # MHA and GQA (3 KV heads)
def test_fp32_pages_match_reference_attention(window, heads):
    store = PageStore(KVConfig(format="fp32", **SMALL), window)
    assert _run(store, CHUNKS, heads) < 1e-4
    if window:
        assert store.first_position() > 0  # a ring: old pages dropped
    else:
        assert store.pages > 3


@pytest.mark.parametrize("window", [None, 40])
def test_online_fold_matches_reference_for_few_rows(window, monkeypatch):
    # Decode normally takes the two-pass path; past TWO_PASS_SCORES the online fold.
    import kvexec.attention

    monkeypatch.setattr(kvexec.attention, "TWO_PASS_SCORES", 0)
    store = PageStore(KVConfig(format="fp32", **SMALL), window)
    sinks = mx.array(np.linspace(-1, 2, 9).astype(np.float32))
    assert _run(store, CHUNKS, 9, sinks) < 1e-4


@pytest.mark.parametrize("window", [None, 40])
def test_numpy_softmax_step_matches_reference(window, monkeypatch):
    # On CPU without the native kernels, score blocks past EVAL_EVERY_BLOCK take numpy's
    # exp, written in place.
    import kvexec.attention

    monkeypatch.setattr(kvexec.attention, "rows_kernel", lambda: None)
    monkeypatch.setattr(kvexec.attention, "EVAL_EVERY_BLOCK", 1)
    monkeypatch.setattr(kvexec.attention, "TWO_PASS_SCORES", 0)
    calls = []
    original = kvexec.attention.softmax_step_numpy
    monkeypatch.setattr(kvexec.attention, "softmax_step_numpy", lambda s, m: calls.append(1) or original(s, m))
    store = PageStore(KVConfig(format="q8", **SMALL), window)
    assert _run(store, [70, 1, 33, 120], 9, rel=True) < BOUNDS["q8"]
    assert calls if mx.default_device() == mx.cpu else not calls


def test_attention_sinks_logit():
    sinks = mx.array(np.linspace(-1, 2, 9).astype(np.float32))
    store = PageStore(KVConfig(format="fp32", **SMALL))
    assert _run(store, [20, 1, 33], heads=9, sinks=sinks) < 1e-4


# Documented error bounds: relative RMS error of the attention output against fp32
# reference attention, unit-normal q, k, v, 32-value groups (bounds ~1.5x measured).
BOUNDS = {"fp16": 1e-3, "q8": 0.01, "q4": 0.15, "q3": 0.3, "q2": 0.7,
          "q8c": 0.01, "q4c": 0.15, "q3c": 0.3, "q2c": 0.7,  # "c": keys grouped per channel
          "r4": 0.2, "r3": 0.35,  # rotated codebook
          "k8v4": 0.15, "k8v3": 0.3, "k8cv4": 0.15}  # mixed widths


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
def test_quantized_formats_error_bounds(fmt):
    config = {**SMALL, "page_size": 32}  # per-channel keys group 32 tokens of a page
    store = PageStore(KVConfig(format=fmt, **config))
    assert _run(store, [64, 1, 40, 1, 33], heads=9, rel=True) < BOUNDS[fmt]
    assert store.pages >= 3


def test_rotation_is_orthogonal_and_levels_are_lloyd_max():
    from kvexec.rotated import lloyd_max_gaussian, rotation

    r = rotation(3, 64)
    eye = r @ r.swapaxes(-1, -2)
    assert float(mx.abs(eye - mx.eye(64)).max()) < 1e-5
    levels = lloyd_max_gaussian(2)  # the classic 4-level Gaussian quantizer
    assert np.allclose(levels, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-3)


def test_per_channel_keys_need_whole_groups_per_page():
    with pytest.raises(ValueError, match="multiple of 32"):
        PageStore(KVConfig(format="q4c", page_size=16, block_tokens=32))


@pytest.mark.parametrize("fmt", ["q4", "q4c"])
def test_quantized_trim_keeps_what_attention_saw(fmt):
    """Trimming into a quantized page brings its tokens back as the values attention
    already used, so attending after a trim equals attending before it."""
    config = KVConfig(format=fmt, page_size=32, hot_window=8, sink_tokens=2, block_tokens=64)
    store = PageStore(config)
    x = mx.random.normal((1, 3, 150, 64))
    store.append(x, x)
    q = mx.random.normal((1, 9, 1, 64))
    before = blockwise_attention(q, store.blocks(), 99, 0.125)  # position 99 sees 0..99
    store.trim(50)
    after = blockwise_attention(q, store.blocks(), 99, 0.125)
    assert store.offset == 100 and float(mx.abs(before - after).max()) < 1e-4


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_bytes_per_token_is_exact(name):
    fmt = get_format(name)
    store = PageStore(KVConfig(format=name, page_size=32, hot_window=0, sink_tokens=0, block_tokens=32))
    x = mx.random.normal((1, 3, 32 * 4, 64))
    store.append(x, x)
    page_bytes = sum(s.nbytes for s in store.segments)
    assert store.pages == 4 and page_bytes == 4 * 32 * fmt.bytes_per_token(3, 64)


def test_a_store_holds_no_more_memory_than_it_counts():
    # sinks sliced from a long first chunk once kept that whole chunk alive as a view
    store = PageStore(KVConfig(format="q4", **SMALL))
    mx.eval(store.arrays())
    before = mx.get_active_memory()
    x = mx.random.normal((1, 3, 4096, 64))
    store.append(x, x + 1)
    mx.eval(store.arrays())
    del x
    held = mx.get_active_memory() - before
    assert held <= store.nbytes + 65536  # what nbytes reports stays resident (MLX rounds each allocation up)
    assert store.nbytes < 4096 * 3 * 64 * 4  # pages: far less than the fp32 chunk


def test_pages_are_written_in_place_and_window_layers_stay_bounded():
    x = mx.random.normal((1, 3, 16, 64))
    ring = PageStore(KVConfig(format="q4", **SMALL), window=40)
    sizes = []
    for _ in range(40):
        ring.append(x[..., :5, :], x[..., :5, :])
        sizes.append(sum(s.capacity for s in ring.segments))
    assert ring.first_position() > 0 and max(sizes) <= 40 + 5 + 3 * 16  # a ring, not a log
    full = PageStore(KVConfig(format="q4", **SMALL))
    full.append(x, x)
    full.append(x, x)
    first = full.segments[0]
    mx.eval(full.arrays())
    before = mx.get_active_memory()
    for _ in range(6):
        full.append(x, x)
        mx.eval(full.arrays())
    assert full.segments[0] is first and first.length == first.capacity
    grown = mx.get_active_memory() - before
    assert grown <= sum(s.nbytes for s in full.segments[1:]) + 2 * x.nbytes * 4  # no copies of old pages


@pytest.mark.parametrize("window", [None, 40])
def test_trim_then_continue_matches_fresh(window):
    rng = np.random.default_rng(1)
    cfg = KVConfig(format="fp32", **SMALL)
    a, b = PageStore(cfg, window), PageStore(cfg, window)
    x = mx.array(rng.normal(size=(1, 3, 70, 64)).astype(np.float32))
    y = mx.array(rng.normal(size=(1, 3, 9, 64)).astype(np.float32))
    a.append(x, x)
    assert a.can_trim(30) and a.trim(30) == 30
    a.append(y, y)
    b.append(x[..., :40, :], x[..., :40, :])
    b.append(y, y)
    q = mx.array(rng.normal(size=(1, 9, 9, 64)).astype(np.float32))
    oa = blockwise_attention(q, a.blocks(), a.offset - 9, 0.125, window)
    ob = blockwise_attention(q, b.blocks(), b.offset - 9, 0.125, window)
    assert a.offset == b.offset == 49
    assert float(mx.abs(oa - ob).max()) < 1e-5


def test_window_layer_refuses_trim_past_what_it_dropped():
    store = PageStore(KVConfig(format="fp32", **SMALL), window=20)
    x = mx.random.normal((1, 3, 20, 64))
    for _ in range(10):
        store.append(x, x)
    assert store.can_trim(5)
    assert not store.can_trim(150) and store.trim(150) == 0 and store.offset == 200


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown KV format"):
        KVConfig(format="q5")


# -- the seam, on tiny models of each supported layer kind ---------------------------

TINY = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                  rope_theta=10000.0, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                        vocab_size=97, sliding_window=24, sliding_window_pattern=6, query_pre_attn_scalar=32),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  vocab_size=97, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       vocab_size=97, rope_theta=10000.0, max_position_embeddings=512,
                       linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                       num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=96,
                       mlp_only_layers=[0, 1, 2, 3], moe_intermediate_size=32, partial_rotary_factor=0.5,
                       full_attention_interval=2),
}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_model_through_kvexec_matches_stock_cache(arch):
    model = in_memory_model(TINY[arch])
    kvexec.install(model)
    stock, paged = make_prompt_cache(model), kvexec.make_cache(model, KVConfig(format="fp32", **SMALL))
    assert any(isinstance(c, kvexec.PagedKVCache) for c in paged)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 97, 90)]
    worst = 0.0
    for piece in (tokens[:37], tokens[37:38], tokens[38:70], tokens[70:71], tokens[71:90]):
        x = mx.array(piece)[None]
        a, b = model(x, cache=stock), model(x, cache=paged)
        worst = max(worst, float(mx.abs(a - b).max()))
    assert worst < 1e-4, worst
    assert sum(c.nbytes for c in paged) > 0


# -- end to end ---------------------------------------------------------------------


def test_engine_reuse_with_small_pages_matches_fresh(tiny_gemma3_dir):
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig

    config = lambda: EngineConfig(kv=KVConfig(format="fp32", **SMALL))  # noqa: E731
    engine = Engine(str(tiny_gemma3_dir), config=config())
    sp = SamplingParams(temperature=0, max_tokens=6)
    first = "the " * 30
    engine.complete(first, sp)
    assert any(c.store.pages for c in engine.states.last.cache)
    for follow in (first + "and on", "the " * 25 + "x"):
        got = engine.complete(follow, sp)
        assert got == Engine(str(tiny_gemma3_dir), config=config()).complete(follow, sp)


def test_smollm2_fp16_pages_greedy_identical_to_stock(smollm2_gguf):
    from bench.common import prompt_tokens
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig

    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # float32 activations: rounded ones (cpu-int8) can turn fp16 pages' last-bit
    # differences into a flipped rounding and then a near tie: not the pages' doing
    policy = "cpu-native"
    paged = Engine(str(smollm2_gguf), config=EngineConfig(kv=KVConfig(format="fp16"), policy=policy))
    tokens = prompt_tokens(paged.tokenizer, 700)  # > sinks + hot window: real pages
    got = paged.reply(tokens, sp)
    assert sum(c.store.pages for c in paged.states.last.cache) > 0
    stock = Engine(str(smollm2_gguf), config=EngineConfig(kv=None, policy=policy))
    want = stock.reply(tokens, sp)
    assert len(got.tokens) == 64 and got.tokens == want.tokens
    assert got.stats.memory.kv < want.stats.memory.kv


# -- retention and page selection ---------------------------------------------------

def test_head_dim_too_small_for_groups_is_a_clear_error():
    store = PageStore(KVConfig(format="q4"))
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        store.append(mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 4, 16)))

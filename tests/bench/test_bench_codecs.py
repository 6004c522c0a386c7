"""The key and value codec study (bench/codecs.py): RoPE undone and redone exactly, the QJL
residual's unbiased inner products, every codec measured on every layer of a tiny model,
and the bits-at-equal-error interpolation the savings are read from."""

import math

import mlx.core as mx
import numpy as np
import pytest

from bench.codecs import allocated, bits_at, family, key_bound, pre_rope, qjl, rope, savings, study, value_bound
from kvexec.rotated import RotatedCodec
from tests.helpers.tiny_paged import ByteTokenizer, paged_model

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_model():
    return paged_model(TINY)


def test_pre_rope_keys_are_quantized_where_rope_has_not_spun_them(tiny_model):
    module = tiny_model.layers[0].self_attn.rope
    x = mx.random.normal((1, 2, 256, 64))
    assert float(mx.abs(rope(rope(x, module, inverse=True), module) - x).max()) < 1e-5
    # keys constant per channel before RoPE: stored per channel they are exact there, while
    # after RoPE the fast pairs sweep their whole circle within each group of tokens
    raw = mx.broadcast_to(mx.random.normal((1, 2, 1, 64)), (1, 2, 256, 64))
    keys = rope(raw, module)
    q = np.abs(np.random.default_rng(0).standard_normal((2, 256, 64))) + 0.1
    before, bits_before = pre_rope(q, keys, 4, module)
    after, bits_after = allocated(q, keys, 4)
    assert bits_before == bits_after == 4 + 32 / 128
    err = lambda got: float(mx.sqrt(((got - keys) ** 2).sum() / (keys**2).sum()))  # noqa: E731
    assert err(before) < 1e-3 < 0.01 < err(after)


def test_qjl_residual_makes_inner_products_unbiased():
    rng = np.random.default_rng(1)
    mean = rng.standard_normal(64).astype(np.float32) * 3
    k = mx.array(mean + rng.standard_normal((1, 1, 1, 64)).astype(np.float32))
    q = mx.array(mean / np.linalg.norm(mean))
    exact = float((k @ q).item())
    estimates = [float((qjl(k, 2, seed)[0] @ q).item()) for seed in range(400)]
    assert qjl(k, 2)[1] == 2 + 32 / 64  # one-bit codes, one bit of signs, two fp16 norms per token
    assert abs(np.mean(estimates) / exact - 1) < 0.03  # unbiased over the sketch's draws
    mse_only = RotatedCodec(1).decode(RotatedCodec(1).encode(k))
    assert float((mse_only @ q).item()) / exact < 0.9  # the codebook alone shrinks q . k


def test_study_measures_every_codec_on_every_layer(tiny_model):
    result = study(tiny_model, ByteTokenizer(), max_tokens=256)
    assert result["tokens"] == 256
    for side in ("keys", "values"):
        families = {}
        for name, row in result[side].items():
            assert len(row["errors"]) == TINY["num_hidden_layers"]
            assert row["summed_squares"] == pytest.approx(sum(e * e for e in row["errors"]))
            families.setdefault(family(name), []).append(row)
        for rows in families.values():  # within a family more bits lose less
            ordered = [r["summed_squares"] for r in sorted(rows, key=lambda r: r["bits"])]
            assert ordered == sorted(ordered, reverse=True)
    assert {"a", "pre", "j", "o4a", "r", "qjl", "c", "cr", "bound"} <= {family(n) for n in result["keys"]}
    assert "vbound-" in {family(n) for n in result["values"]}
    assert result["keys"]["a5"]["bits"] == 5.25 and result["values"]["vr64-5"]["bits"] == 5.5
    saved = savings(result["keys"], "a")
    assert set(saved["pre"]) == {"a3", "a4", "a5", "a6"} and "a" not in saved


def test_bits_at_interpolates_log_error_in_bits():
    rows = [{"bits": 4.0, "summed_squares": 1e-2}, {"bits": 5.0, "summed_squares": 1e-3}]
    assert bits_at(rows, 1e-2) == pytest.approx(4.0)
    assert bits_at(rows, math.sqrt(1e-5)) == pytest.approx(4.5)
    assert bits_at(rows, 1e-4) == pytest.approx(6.0)  # past the ends along the nearest pair
    side = {"a4": rows[0], "a5": rows[1], "x4": {"bits": 3.5, "summed_squares": 1e-2},
            "x5": {"bits": 4.5, "summed_squares": 1e-3}}
    assert savings(side, "a") == {"x": {"a4": 0.5, "a5": 0.5}}


def test_rate_distortion_bounds_reach_gaussian_distortion_at_their_rate():
    rng = np.random.default_rng(2)
    # values: each token's own scale; one more bit a value divides the squared error by 4
    scale = np.exp(rng.standard_normal((1, 2, 512, 1)))
    v = mx.array((rng.standard_normal((1, 2, 512, 64)) * scale).astype(np.float32))
    for rate in (3, 5):
        got, bits = value_bound(v, rate)
        assert bits == rate + 16 / 64  # the norm, one fp16 number a token and head
        rel = float(((got - v) ** 2).sum() / (v**2).sum())
        assert rel == pytest.approx(2.0 ** (-2 * rate), rel=0.05)
    # keys: a channel no query reads gets no bits; at equal weights every channel D = var 2^-2R
    k = mx.array((rng.standard_normal((1, 1, 256, 64)) * 2 + 5).astype(np.float32))
    q = np.ones((1, 256, 64))
    got, bits = key_bound(q, k, 4)
    assert bits == 4 + 32 / 128  # mean and variance per channel and group, as the codec's scale and bias
    err = np.array((got - k) ** 2)[0, 0].mean(axis=0)
    var = np.array(k)[0, 0].reshape(2, 128, 64).var(axis=1).mean(axis=0)
    assert np.median(err / var) == pytest.approx(2.0**-8, rel=0.2)
    q[..., :32] = 0  # half the channels never meet a query: the other half take every bit
    got, _ = key_bound(q, k, 4)
    err = np.array((got - k) ** 2)[0, 0].mean(axis=0)
    assert np.median(err[32:] / var[32:]) == pytest.approx(2.0**-16, rel=0.2)
    assert np.median(err[:32] / var[:32]) == pytest.approx(1.0, rel=0.2)

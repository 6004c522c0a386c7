"""mlx-lm's layers with JustFit's CPU kernels (justfit/model/native_layers.py): the gated MLP
activation equals MLX's, the native llama and Gemma 3 layers, attention, MLPs and norms
compute what mlx-lm's own classes do on the same weights and paged cache, a layer's fused
steps what its native operations do one by one (bit for bit), a decode step makes a
handful of operations a layer, and anything the kernels cannot take runs mlx-lm's code."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.activations import swiglu

from justfit import Engine
from justfit.config import EngineConfig
from justfit.model.native_layers import (NativeGemmaAttention, NativeGemmaBlock, NativeGemmaMLP, NativeGemmaRMSNorm,
                                   NativeLlamaAttention, NativeLlamaBlock, NativeLlamaMLP)
from phaseswap import native
from tests.helpers.tiny_models import write_mlx_folder

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.kernels(), "gated_activation"),
                                reason="native kernels not built here, or off (JUSTFIT_NATIVE=0); ./dev setup builds them")


@pytest.mark.parametrize("n", [7, 8, 3000, 70000])
def test_the_gated_activations_equal_mlx_s(n):
    ext = native.kernels()
    gate = mx.random.normal((n,), key=mx.random.key(n)) * 8
    up = mx.random.normal((n,), key=mx.random.key(n + 1))
    assert mx.allclose(ext.gated_activation(gate, up, 0), swiglu(gate, up), rtol=1e-5, atol=1e-6)
    assert mx.allclose(ext.gated_activation(gate, up, 1), nn.gelu_approx(gate) * up, rtol=1e-5, atol=1e-6)
    wide = mx.stack([gate, up], axis=-1)  # strided views are read as their values
    assert mx.allclose(ext.gated_activation(wide[:, 0], wide[:, 1], 0), swiglu(gate, up), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        ext.gated_activation(gate, up, 2)


@pytest.mark.parametrize("activation_bits", [32, 16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_steps_compute_what_each_operation_does_bit_for_bit(activation_bits, offset):
    """A layer's norm before its products, the gate that joins two of them, the norm
    after one and the residual added to it, inside the product's operation: the same
    bits as the native norm, activation and MLX's add one by one, for 1 and 3 rows."""
    ext = native.kernels()
    quantized = [mx.quantize(mx.random.normal((n, 128), key=mx.random.key(n)), 32, 4) for n in (96, 96, 128)]
    (gw, gs, gb), (uw, us, ub), (dw, ds, db) = quantized
    pair, down = ([gw, uw], [gs, us], [gb, ub]), ([dw], [ds], [db])
    norm, post = mx.random.normal((128,), key=mx.random.key(1)), mx.random.normal((128,), key=mx.random.key(2))
    steps = {"activation_bits": activation_bits, "norm_eps": 1e-5, "norm_offset": offset}
    for rows in (1, 3):
        x = mx.random.normal((1, rows, 128), key=mx.random.key(rows))
        h = mx.random.normal((1, rows, 128), key=mx.random.key(rows + 9))
        (fused,) = ext.quantized_matvecs(x, *pair, 32, [4, 4], norm=norm, gate=1, **steps)
        normed = ext.rms_norm(x, norm, 1e-5, weight_offset=offset)
        g, u = ext.quantized_matvecs(normed, *pair, 32, [4, 4], activation_bits=activation_bits)
        assert fused.shape == (1, rows, 96) and mx.array_equal(fused, ext.gated_activation(g, u, 1))
        (fused,) = ext.quantized_matvecs(x, *down, 32, [4], post_norm=post, residual=h, **steps)
        y = ext.quantized_matvec(x, dw, ds, db, 32, 4, activation_bits=activation_bits)
        assert mx.array_equal(fused, h + ext.rms_norm(y, post, 1e-5, weight_offset=offset))


def test_fused_steps_refuse_what_they_cannot_compute():
    ext = native.kernels()
    w, scales, biases = mx.quantize(mx.random.normal((64, 128)), 32, 4)
    x = mx.random.normal((1, 128))
    one, two = ([w], [scales], [biases]), ([w, w], [scales, scales], [biases, biases])
    with pytest.raises(ValueError, match="two weights"):
        ext.quantized_matvecs(x, *one, 32, [4], gate=0)
    with pytest.raises(ValueError, match="gate"):
        ext.quantized_matvecs(x, *two, 32, [4, 4], gate=7)
    with pytest.raises(ValueError, match="single output"):
        ext.quantized_matvecs(x, *two, 32, [4, 4], residual=mx.zeros((1, 64)))
    with pytest.raises(ValueError, match="norm"):
        ext.quantized_matvecs(x, *one, 32, [4], norm=mx.ones((64,)))  # x's width is 128
    with pytest.raises(ValueError, match="residual"):
        ext.quantized_matvecs(x, *one, 32, [4], residual=mx.zeros((1, 128)))


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("layers") / "q4", "llama", seed=5, quantize_bits=4,
                            layers=3, vocab_size=288)


def _step_logits(engine: Engine, tokens: list[int]) -> list[mx.array]:
    """Logits of a prefill and three decode steps on a fresh paged cache."""
    cache = engine.new_cache()
    out = []
    with engine.swap.phase("decode"):
        logits = engine.model(mx.array([tokens]), cache=cache)[0, -1]
        out.append(logits)
        for t in (5, 17, 200):
            out.append(engine.model(mx.array([[t]]), cache=cache)[0, -1])
    mx.eval(out)
    return out


def _back_to(engine: Engine, classes: dict) -> int:
    """Give the engine's modules of `classes`' keys (hooked by PhaseSwap or not: every
    form is resident at decode) the class each maps to, the same modules and weights;
    how many."""
    count = 0
    for _, m in engine.model.named_modules():
        base = getattr(type(m), "phaseswap_base", type(m))
        if base in classes:
            m.__class__ = classes[base]
            count += 1
    return count


_LLAMA_BLOCKS = {NativeLlamaBlock: llama.TransformerBlock}
_GEMMA_BLOCKS = {NativeGemmaBlock: gemma3_text.TransformerBlock}


def test_native_layers_compute_what_mlx_lm_s_classes_do(q4_dir):
    engine = Engine(str(q4_dir), config=EngineConfig(policy="cpu-native"))
    tokens = list(range(40, 70))
    fast = _step_logits(engine, tokens)
    assert _back_to(engine, _LLAMA_BLOCKS) == 3
    assert _back_to(engine, {NativeLlamaAttention: llama.Attention, NativeLlamaMLP: llama.MLP}) == 6
    plain = _step_logits(engine, tokens)
    for a, b in zip(fast, plain):  # float32 sums in other orders (attention: kvexec's against the seam's)
        assert mx.allclose(a, b, rtol=1e-4, atol=5e-4), float(mx.abs(a - b).max())


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_layer_s_fused_steps_compute_its_native_operations_bit_for_bit(q4_dir, gemma_dir, family):
    folder, blocks = (q4_dir, _LLAMA_BLOCKS) if family == "llama" else (gemma_dir, _GEMMA_BLOCKS)
    engine = Engine(str(folder), config=EngineConfig(policy="cpu-int16"))
    tokens = list(range(40, 70))
    fused = _step_logits(engine, tokens)
    assert _decode_ops(engine).count("JustFitRmsNorm") == 1  # the final norm: the layers' are fused
    assert _back_to(engine, blocks) >= 2  # the blocks mlx-lm's; attention, MLPs and norms still native
    one_by_one = _step_logits(engine, tokens)
    for a, b in zip(fused, one_by_one):
        assert mx.array_equal(a, b)


def test_a_layer_s_steps_follow_its_modules_and_hold_no_leased_weights(q4_dir):
    """The fused steps' settings are kept across steps, made again when a linear is
    replaced (the new one's weights are the ones computed), and nothing is kept after a
    call that could not take them (prefill's leased dense linears must go with the lease)."""
    engine = Engine(str(q4_dir), config=EngineConfig(policy="cpu-int16"))
    tokens = list(range(40, 70))
    before = _step_logits(engine, tokens)
    block = engine.model.model.layers[1]
    kept = block.__dict__["_native_steps"]
    _step_logits(engine, tokens)
    assert block.__dict__["_native_steps"] is kept
    down = block.mlp["down_proj"]
    twice = type(down).__new__(type(down))  # the same linear with its scales doubled
    twice.__dict__.update(down.__dict__)
    dict.update(twice, dict(down))
    twice["scales"], twice["biases"] = down["scales"] * 2, down["biases"] * 2
    block.mlp["down_proj"] = twice
    after = _step_logits(engine, tokens)
    assert block.__dict__["_native_steps"] is not kept and not mx.array_equal(before[-1], after[-1])
    block.mlp["down_proj"] = down
    assert all(mx.array_equal(a, b) for a, b in zip(before, _step_logits(engine, tokens)))
    assert "_native_steps" in block.__dict__
    engine.swap.prefill_forms = dict.fromkeys(engine.swap.prefill_forms, "dense")
    with engine.swap.phase("prefill"):  # dense linears leased for a long chunk: not fused
        mx.eval(engine.model(mx.array([tokens * 2]), cache=engine.new_cache()))
    assert "_native_steps" not in block.__dict__


def _decode_ops(engine: Engine) -> list[str]:
    """The operations of one decode step after a 20-token prefill."""
    cache = engine.new_cache()
    with engine.swap.phase("decode"):
        mx.eval(engine.model(mx.array([list(range(40, 60))]), cache=cache))
        y = engine.model(mx.array([[7]]), cache=cache)
        dot = io.StringIO()
        mx.export_to_dot(dot, y)
    return [line.split('label ="')[1].split('"')[0] for line in dot.getvalue().splitlines() if 'label ="' in line]


def test_a_decode_step_makes_a_handful_of_operations_a_layer(q4_dir):
    ops = _decode_ops(Engine(str(q4_dir), config=EngineConfig(policy="cpu-native")))
    per_layer = {name: ops.count(name) / 3 for name in set(ops)}
    assert per_layer["JustFitDecodeAttention"] == per_layer["JustFitRopeHeads"] == 1
    assert ops.count("JustFitQuantizedMatvec") == 4 * 3 + 1  # q/k/v joined, o, gate/up joined, down; the head
    # the norms, the activation and the residual adds are inside the products
    assert ops.count("JustFitRmsNorm") == 1 and "JustFitGatedActivation" not in ops  # the final norm
    for name in ("Transpose", "Concatenate", "Add"):
        assert per_layer.get(name, 0) < 1  # none in the layers


def test_gemma_s_mlp_takes_the_native_gate(tmp_path):
    folder = write_mlx_folder(tmp_path / "gemma", "gemma3_text", seed=3, quantize_bits=4)
    engine = Engine(str(folder), config=EngineConfig(policy="cpu-native"))
    mlps = [m for _, m in engine.model.named_modules() if isinstance(m, NativeGemmaMLP)]
    assert len(mlps) >= 2
    x = mx.random.normal((1, 3, mlps[0].gate_proj.weight.shape[1] * 32 // mlps[0].gate_proj.bits))
    fast = mlps[0](x)
    mlps[0].__class__ = gemma3_text.MLP
    assert mx.allclose(fast, mlps[0](x), rtol=1e-4, atol=1e-5)
    half = mlps[1](x.astype(mx.float16))  # float16: MLX's own computes it
    assert half.dtype == mx.float16 and mx.allclose(half.astype(mx.float32), mlps[1](x), rtol=0.05, atol=0.05)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):  # 5-bit, as a GGUF's Q5_0 layers import
    return write_mlx_folder(tmp_path_factory.mktemp("layers") / "gemma", "gemma3_text", seed=8, quantize_bits=5)


def test_gemma_s_native_attention_and_norms_compute_what_mlx_lm_s_do(gemma_dir):
    engine = Engine(str(gemma_dir), config=EngineConfig(policy="cpu-int16"))
    tokens = list(range(40, 70))
    fast = _step_logits(engine, tokens)
    ops = _decode_ops(engine)
    layers = ops.count("JustFitDecodeAttention")
    assert layers >= 2 and ops.count("JustFitRopeHeads") == layers  # q/k norms in the heads' operation
    assert ops.count("JustFitRmsNorm") == 1  # a layer's four in its products; the final one
    assert _back_to(engine, _GEMMA_BLOCKS) == layers
    assert _back_to(engine, {NativeGemmaAttention: gemma3_text.Attention}) == layers
    assert _back_to(engine, {NativeGemmaRMSNorm: gemma3_text.RMSNorm}) >= 6 * layers + 1  # four a layer, q and k's
    plain = _step_logits(engine, tokens)
    for a, b in zip(fast, plain):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4 * float(mx.abs(b).max())), float(mx.abs(a - b).max())

"""The native kernels on 5- and 6-bit weights (a GGUF's Q5_0 / Q5_K import as MLX's 5-bit
affine form) and the native dequantization that makes prefill's dense working copies:
equal to MLX's own (float16 scales exactly), for every width the matvec reads; shapes
and widths it cannot take are refused; the cpu-native forms of a 5-bit model are native
(not re-quantized to q8t) and compute what mlx-lm's classes do."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import pytest

from justfit import Engine
from justfit.config import EngineConfig
from phaseswap import native
from phaseswap.forms import dense_weight
from tests.tiny_models import write_mlx_folder

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.kernels(), "dequantize"),
                                reason="native/ is not built here (./dev setup builds it)")


def _ops(y: mx.array) -> list[str]:
    dot = io.StringIO()
    mx.export_to_dot(dot, y)
    return [line.split('label ="')[1].split('"')[0] for line in dot.getvalue().splitlines() if 'label ="' in line]


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_native_dequantize_is_mlx_s(bits, group):
    w, scales, biases = mx.quantize(mx.random.normal((3, 40, 256), key=mx.random.key(bits + group)), group, bits)
    ext = native.kernels()
    half = (scales.astype(mx.float16), biases.astype(mx.float16))
    ref = mx.dequantize(w, *(a.astype(mx.float32) for a in half), group_size=group, bits=bits)
    assert mx.array_equal(ext.dequantize(w, *half, group, bits), ref)  # float16 scales: exact
    ref32 = mx.dequantize(w, scales, biases, group_size=group, bits=bits)  # one FMA where MLX rounds twice
    assert mx.allclose(ext.dequantize(w, scales, biases, group, bits), ref32, rtol=1e-6, atol=1e-6)


def test_native_dequantize_refuses_what_it_cannot_read():
    ext = native.kernels()
    w, scales, biases = mx.quantize(mx.random.normal((8, 64)), 32, 3)
    with pytest.raises(ValueError, match="bits"):
        ext.dequantize(w, scales, biases, 32, 3)
    w, scales, biases = mx.quantize(mx.random.normal((8, 64)), 32, 4)
    with pytest.raises(ValueError, match="shapes"):
        ext.dequantize(w, scales[:, :1], biases[:, :1], 32, 4)
    with pytest.raises(ValueError, match="float16"):
        ext.dequantize(w, scales, biases.astype(mx.float16), 32, 4)


@pytest.mark.parametrize("bits", [5, 6])
def test_a_quantized_layer_s_dense_copy_is_the_native_dequantization(bits):
    lin = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=bits)
    lin.scales, lin.biases = lin.scales.astype(mx.float16), lin.biases.astype(mx.float16)
    dense = dense_weight(lin)
    assert "JustFitDequantize" in _ops(dense)
    assert mx.array_equal(dense, mx.dequantize(lin.weight, lin.scales.astype(mx.float32),
                                               lin.biases.astype(mx.float32), group_size=32, bits=bits))
    lin2 = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=3)  # MLX's own for the rest
    assert "JustFitDequantize" not in _ops(dense_weight(lin2))


@pytest.mark.parametrize("bits", [5, 6])
def test_5_and_6_bit_blocks_unpack_at_every_offset(bits):
    """Rows whose width is one block (the unpacking's two loads cover exactly its bytes)
    and an identity-like input that reads every value on its own."""
    w, scales, biases = mx.quantize(mx.random.normal((7, 32)) * 3, 32, bits)
    x = mx.eye(32)
    ref = mx.dequantize(w, scales, biases, group_size=32, bits=bits).T
    for activation_bits in (32, 16, 8) if native.rounded_available() else (32,):
        got = native.kernels().quantized_matvec(x, w, scales, biases, 32, bits, activation_bits=activation_bits)
        tol = 1e-5 if activation_bits != 8 else 5e-2
        assert mx.allclose(got, ref, rtol=tol, atol=tol), activation_bits


def test_a_5_bit_model_decodes_on_its_stored_weights(tmp_path):
    folder = write_mlx_folder(tmp_path / "q5", "llama", seed=4, quantize_bits=5, layers=2)
    native_engine = Engine(str(folder), config=EngineConfig(policy="cpu-native"))
    forms = {type(m).__name__ for _, m in native_engine.model.named_modules() if hasattr(m, "bits")}
    assert forms == {"NativeQuantizedLinear", "NativeQuantizedEmbedding"}  # no q8t re-quantization
    compact = Engine(str(folder), config=EngineConfig(policy="cpu-compact"))  # MLX's kernels, the same weights
    assert native_engine.swap.registry.resident_bytes() <= compact.swap.registry.resident_bytes()
    ids = mx.array([[5, 17, 99, 3, 250, 41]])
    with native_engine.swap.phase("decode"), compact.swap.phase("decode"):
        a, b = native_engine.model(ids), compact.model(ids)
    assert mx.allclose(a, b, rtol=1e-4, atol=1e-4 * float(mx.abs(b).max()))

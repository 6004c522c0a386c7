"""The native kernels on 5- and 6-bit weights (a GGUF's Q5_0 / Q5_K import as MLX's 5-bit
affine form) and the native dequantization that makes prefill's dense working copies and
decoded pages: equal to MLX's own (float16 scales exactly), at every width MLX stores;
keys stored per channel decoded in one operation as MLX's several would; shapes
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
from tests.helpers.tiny_models import write_mlx_folder

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.kernels(), "dequantize"),
                                reason="native kernels not built here, or off (JUSTFIT_NATIVE=0); ./dev setup builds them")


def _ops(y: mx.array) -> list[str]:
    dot = io.StringIO()
    mx.export_to_dot(dot, y)
    return [line.split('label ="')[1].split('"')[0] for line in dot.getvalue().splitlines() if 'label ="' in line]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
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
    w, scales, biases = mx.quantize(mx.random.normal((8, 64)), 32, 4)
    with pytest.raises(ValueError, match="bits"):
        ext.dequantize(w, scales, biases, 32, 7)
    with pytest.raises(ValueError, match="shapes"):
        ext.dequantize(w, scales[:, :1], biases[:, :1], 32, 4)
    with pytest.raises(ValueError, match="float16"):
        ext.dequantize(w, scales, biases.astype(mx.float16), 32, 4)


def _mlx_only(monkeypatch) -> None:
    import kvexec.kernels

    monkeypatch.setattr(kvexec.kernels, "rows_kernel", lambda: None)


@pytest.mark.parametrize("fmt", ["q8c", "q4c", "k4a128v4r64~5632.2365", "k5a64v5r64~6653.3566"])
def test_keys_stored_per_channel_decode_natively_as_mlx_does(fmt, monkeypatch):
    """One native operation (every width's channels put back in place, tokens-major) where
    MLX took a dequantize per width, a transpose, a concatenation and a gather; equal to
    that, whole segments and views of part of one."""
    from kvexec import get_format

    keys = get_format(fmt).keys
    D = 4 if "~" in fmt else 64
    x = mx.random.normal((2, 2, 384, D), key=mx.random.key(len(fmt)))
    storage = keys.allocate((2, 2), 512, D)
    keys.write(storage, keys.encode(x), 0, 384)
    views = [keys.encode(x), keys.view(storage, 0, 256), keys.view(storage, 128, 384)]
    got = [keys.decode(v) for v in views]
    assert "JustFitDequantizeChannels" in _ops(got[0])
    with monkeypatch.context() as m:
        _mlx_only(m)
        ref = [keys.decode(v) for v in views]
    for g, r in zip(got, ref):
        assert g.shape == r.shape and mx.array_equal(g, r)


def test_native_channel_dequantize_refuses_parts_that_do_not_agree():
    ext = native.kernels()
    w, scales, biases = mx.quantize(mx.random.normal((1, 2, 8, 256)), 128, 4)
    with pytest.raises(ValueError, match="head_dim"):
        ext.dequantize_channels([w], [scales], [biases], [], 128, [4], 16)
    with pytest.raises(ValueError, match="columns"):
        ext.dequantize_channels([w], [scales], [biases], [mx.zeros((3, 8), dtype=mx.int32)], 128, [4], 8)
    with pytest.raises(ValueError, match="per part"):  # two parts need their columns
        ext.dequantize_channels([w, w], [scales, scales], [biases, biases], [], 128, [4, 4], 16)
    cols = [mx.zeros((2, 8), dtype=mx.int32)] * 2
    with pytest.raises(ValueError, match="shapes"):
        ext.dequantize_channels([w, w[..., :16]], [scales, scales], [biases, biases], cols, 128, [4, 4], 16)


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

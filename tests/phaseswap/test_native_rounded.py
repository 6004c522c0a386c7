"""The native kernel's rounded activations (cpu-int16, cpu-int8): each product is the
float product with x's blocks of 32 rounded to 16 or 8 bits, and the policies hold
cpu-native's bytes with logits within the rounding of its."""

from __future__ import annotations

import mlx.core as mx
import pytest

from justfit import Engine
from justfit.config import EngineConfig
from phaseswap import native
from tests.helpers.tiny_models import write_mlx_folder

needs_kernel = pytest.mark.skipif(not native.available(), reason="native kernels not built here, or off (JUSTFIT_NATIVE=0); ./dev setup builds them")


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("native") / "q4", "llama", seed=9, quantize_bits=4,
                            layers=3, vocab_size=288)


def _rounded_blocks(x: mx.array, bits: int) -> mx.array:
    """x with each block of 32 rounded to `bits`-bit integers at its largest magnitude
    (as the kernel's rounded activations), back in float32."""
    top = 2 ** (bits - 1) - 1
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = mx.abs(blocks).max(axis=-1, keepdims=True) / top
    q = mx.where(d > 0, mx.round(blocks / mx.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape)


@needs_kernel
@pytest.mark.skipif(not native.rounded_available(), reason="rounded activations need AVX2")
@pytest.mark.parametrize("activation_bits,error", [(8, (1e-4, 1.5e-2)), (16, (1e-7, 1e-4))])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64), (8, 128), (5, 32), (6, 64)])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_rounded_activations_are_the_product_with_x_rounded_blocks(activation_bits, error, bits, group, rows):
    """cpu-int8 / cpu-int16 products: exactly (to float32 summation) the float product with
    x's blocks of 32 rounded to that many bits, so their error is the rounding's."""
    mx.random.seed(bits * 7 + group + rows)
    w, scales, biases = mx.quantize(mx.random.normal((200, 512)), group, bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    x = mx.random.normal((rows, 512)) * mx.linspace(0.1, 3, 512)  # blocks of different scales
    ext = native.kernels()
    got = ext.quantized_matvec(x, w, scales, biases, group, bits, activation_bits=activation_bits)
    exact = ext.quantized_matvec(x, w, scales, biases, group, bits)
    rounded = ext.quantized_matvec(_rounded_blocks(x, activation_bits), w, scales, biases, group, bits)
    scale = float(mx.abs(exact).max())
    assert mx.allclose(got, rounded, rtol=1e-5, atol=2e-5 * scale)
    rel = float(mx.sqrt(((got - exact) ** 2).mean() / (exact**2).mean()))
    assert error[0] < rel < error[1]  # rounded, not exact
    zero = ext.quantized_matvec(mx.zeros((1, 512)), w, scales, biases, group, bits, activation_bits=activation_bits)
    assert mx.array_equal(zero, mx.zeros((1, 200)))  # an all-zero block has no scale to divide by
    with pytest.raises(ValueError, match="activation_bits"):
        ext.quantized_matvec(x, w, scales, biases, group, bits, activation_bits=4)


@needs_kernel
@pytest.mark.skipif(not native.rounded_available(), reason="rounded activations need AVX2")
@pytest.mark.parametrize("policy,bits", [("cpu-int16", 16), ("cpu-int8", 8)])
def test_rounded_policies_hold_cpu_native_s_bytes_and_logits_within_the_rounding(q4_dir, policy, bits):
    """cpu-int16 / cpu-int8: the same stored bytes as cpu-native, every native product on
    rounded activations, the logits within the rounding's error of cpu-native's."""
    plain = Engine(str(q4_dir), config=EngineConfig(policy="cpu-native"))
    rounded = Engine(str(q4_dir), config=EngineConfig(policy=policy))
    assert rounded.swap.registry.resident_bytes() == plain.swap.registry.resident_bytes()
    forms = [m for _, m in rounded.model.named_modules() if native.is_native(m)]
    assert forms and all(m.__dict__["activation_bits"] == bits for m in forms)
    ids = mx.array([[5, 17, 99, 3, 250, 41]])
    a, b = plain.model(ids), rounded.model(ids)  # the resident (decode) forms, every row
    worst = float(mx.abs(a - b).max()) / float(mx.abs(a).max())
    assert 0 < worst < (0.05 if bits == 8 else 5e-4)


@needs_kernel
@pytest.mark.skipif(not native.rounded_available(), reason="rounded activations need AVX2")
@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_several_products_of_one_row_are_each_product_bit_for_bit(activation_bits, scale_dtype):
    """One row's products with weights of every width (one parallel loop over all their
    columns) are the same bits as each weight's own product; widths not a multiple of 4
    columns, or several rows, take the product one by one."""
    ext = native.kernels()
    for outs in ([96, 32, 40, 64], [36, 30]):
        weights = []
        for i, (out, bits) in enumerate(zip(outs, [4, 5, 6, 8])):
            w, s, b = mx.quantize(mx.random.normal((out, 256), key=mx.random.key(i)), 64, bits)
            weights.append((w, s.astype(scale_dtype), b.astype(scale_dtype), bits))
        for rows in (1, 3):
            x = mx.random.normal((1, rows, 256), key=mx.random.key(rows))
            joint = ext.quantized_matvecs(x, [w for w, *_ in weights], [s for _, s, *_ in weights],
                                          [b for *_, b, _ in weights], 64, [bits for *_, bits in weights],
                                          activation_bits=activation_bits)
            for got, (w, s, b, bits) in zip(joint, weights):
                alone = ext.quantized_matvec(x, w, s, b, 64, bits, activation_bits=activation_bits)
                assert mx.array_equal(got, alone)

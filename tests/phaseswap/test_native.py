"""The native kernel (native/qmatvec.cpp) and the `native` resident form: the product
equals MLX's own on the stored weights for 4, 5, 6 and 8 bits, any number of rows and
leading dimensions; shapes it cannot take are refused; the cpu-native policy holds
the stored bytes (not more than cpu-compact) and generates the tokens cpu-compact
does; without the built kernel the form falls back to MLX's kernels."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from phaseswap import native
from tests.helpers.tiny_models import write_mlx_folder

def _graph(y: mx.array) -> str:
    """The operations MLX would run for `y` (its dot graph)."""
    out = io.StringIO()
    mx.export_to_dot(out, y)
    return out.getvalue()


needs_kernel = pytest.mark.skipif(not native.available(), reason="native kernels not built here, or off (JUSTFIT_NATIVE=0); ./dev setup builds them")


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64), (8, 128), (5, 32), (6, 64), (5, 128)])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_the_kernel_equals_mlx_on_the_stored_weights(bits, group, rows):
    mx.random.seed(bits * rows + group)
    w, scales, biases = mx.quantize(mx.random.normal((192, 256)), group, bits)
    x = mx.random.normal((rows, 256))
    ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits)
    got = native.kernels().quantized_matvec(x, w, scales, biases, group, bits)
    assert got.shape == ref.shape and got.dtype == mx.float32
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-4 * float(mx.abs(ref).max()))


@needs_kernel
def test_the_kernel_takes_leading_dimensions_and_refuses_what_it_cannot_compute():
    w, scales, biases = mx.quantize(mx.random.normal((64, 128)), 32, 4)
    ext = native.kernels()
    x = mx.random.normal((2, 3, 128))
    ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=32, bits=4)
    assert mx.allclose(ext.quantized_matvec(x, w, scales, biases, 32, 4), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        ext.quantized_matvec(mx.random.normal((1, 64)), w, scales, biases, 32, 4)  # in does not match
    with pytest.raises(ValueError):
        ext.quantized_matvec(x, w, scales, biases, 32, 3)
    with pytest.raises(ValueError):
        ext.quantized_matvec(x.astype(mx.float16), w, scales, biases, 32, 4)


@needs_kernel
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_the_kernel_reads_strided_inputs_and_float16_scales_as_stored(scale_dtype):
    """No Contiguous node is made for the inputs: a transposed activation or a strided
    weight is copied when the product runs, with the same result."""
    w, scales, biases = mx.quantize(mx.random.normal((128, 256)), 32, 4)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    x = mx.random.normal((256, 5)).T  # a view, not row-contiguous
    ext = native.kernels()
    want = mx.quantized_matmul(mx.array(x), w, scales.astype(mx.float32), biases.astype(mx.float32),
                               transpose=True, group_size=32, bits=4)
    assert mx.allclose(ext.quantized_matvec(x, w, scales, biases, 32, 4), want, rtol=1e-5, atol=1e-3)
    rows = ext.quantized_matvec(x, w[::2], scales[::2], biases[::2], 32, 4)  # every other output row
    assert mx.allclose(rows, want[:, ::2], rtol=1e-5, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("traditional", [False, True])
def test_native_rope_is_mlx_s_rope_as_one_operation(traditional):
    """Same angles as mx.fast.rope (its inverse frequencies, float32), any strides, partial
    dims, large offsets; an array of per-row offsets (a batch) goes to MLX's own."""
    mine, theirs = native.NativeRoPE(32, traditional=traditional, base=100000.0, scale=0.5), nn.RoPE(
        32, traditional=traditional, base=100000.0, scale=0.5)
    x = mx.random.normal((2, 7, 9, 64)).transpose(0, 2, 1, 3)  # [B, H, L, D] as attention makes it
    for offset in (0, 5, 100_000):
        assert mx.abs(mine(x, offset=offset) - theirs(x, offset=offset)).max().item() < 1e-5
    rows = mx.array([3, 40])
    assert mx.array_equal(mine(x, offset=rows), theirs(x, offset=rows))
    model = nn.Sequential(nn.RoPE(16), nn.Linear(4, 4), nn.RMSNorm(4))
    assert native.install_ops(model) == 2 and type(model.layers[0]) is native.NativeRoPE
    assert model.layers[0].dims == 16 and not model.layers[0].parameters()
    assert type(model.layers[2]) is native.NativeRMSNorm and model.layers[2].weight is not None


@needs_kernel
def test_native_rms_norm_is_mlx_s_and_keeps_its_weight():
    norm = nn.RMSNorm(96, eps=1e-6)
    norm.weight = mx.random.normal((96,))
    x = mx.random.normal((4, 96, 3)).swapaxes(1, 2) * 5  # strided
    mine = native._recast(norm, native.NativeRMSNorm)
    assert mx.allclose(mine(x), norm(x), rtol=1e-5, atol=1e-5)
    offset = native.kernels().rms_norm(x, norm.weight, 1e-6, weight_offset=1.0)  # Gemma's 1 + weight
    assert mx.allclose(offset, mx.fast.rms_norm(x, 1.0 + norm.weight, 1e-6), rtol=1e-5, atol=1e-5)
    assert mx.array_equal(mine(x.astype(mx.float16)), norm(x.astype(mx.float16)))  # MLX's own off float32
    assert mine.parameters().keys() == norm.parameters().keys()


@needs_kernel
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (8, 64), (4, 128), (2, 32), (3, 64), (5, 128), (6, 32)])
@pytest.mark.parametrize("rows", [1, 3, 24])
def test_the_page_product_equals_mlx_s_untransposed_quantized_matmul(bits, group, rows):
    """Attention over quantized pages at decode: q K for keys stored per channel
    ([.., head_dim, tokens]) and p V for values per token, both MLX's transpose=False
    layout; KVExec's codecs use it for few float32 rows and MLX's kernel otherwise.
    Every width MLX stores (2-6 and 8 bits: one little-endian bit stream)."""
    from kvexec.affine import Codec
    from kvexec.kernels import ROWS_KERNEL_MAX

    mx.random.seed(bits + rows + group)
    for k, n in ((64, 1536), (1024, 128)):  # scores over 1,536 tokens; values of 1,024 tokens
        w, scales, biases = mx.quantize(mx.random.normal((2, 3, k, n)), group, bits)
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
        x = mx.random.normal((2, 3, rows, k))
        want = mx.quantized_matmul(x, w, scales, biases, transpose=False, group_size=group, bits=bits)
        got = native.kernels().quantized_matmul_rows(x, w, scales, biases, group, bits)
        assert got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4 * float(mx.abs(want).max()))
        wide = native.kernels().quantized_matmul_rows(x, w, scales.astype(mx.float32), biases.astype(mx.float32),
                                                      group, bits)  # scales as float32: the same values
        assert mx.allclose(wide, got, rtol=1e-5, atol=1e-5 * float(mx.abs(want).max()))
        wider = mx.concatenate([mx.zeros((2, 3, rows, 8)), x, mx.ones((2, 3, rows, 8))], axis=-1)
        strided = native.kernels().quantized_matmul_rows(wider[..., 8:8 + k], w, scales, biases, group, bits)
        assert mx.array_equal(strided, got)  # a slice (decode's probabilities per block) read as its values
        for axis in (-1, -2):  # a segment's storage holds more tokens than are written: read in place
            held = [mx.concatenate([a, mx.zeros_like(a)], axis=axis) for a in (w, scales, biases)]
            mx.eval(held)
            view = [a[..., :s.shape[-1]] if axis == -1 else a[..., :s.shape[-2], :] for a, s in zip(held, (w, scales, biases))]
            mx.eval(view)  # views of the storage, not copies
            y = native.kernels().quantized_matmul_rows(x, *view, group, bits)
            assert "Contiguous" not in _graph(y)
            assert mx.array_equal(y, got)
    codec = Codec(bits, group, per_channel=True)
    keys = codec.encode(mx.random.normal((1, 3, 256, 64)))
    q = mx.random.normal((1, 3, rows, 64))
    ref = mx.quantized_matmul(q, keys["w"], keys["scales"], keys["biases"], transpose=False, group_size=group, bits=bits)
    assert mx.allclose(codec.scores(q, keys), ref, rtol=1e-4, atol=1e-3)
    assert rows <= ROWS_KERNEL_MAX


@needs_kernel
def test_the_native_form_is_the_stored_layer_and_falls_back_off_float32():
    lin = nn.QuantizedLinear(128, 64, bias=True, group_size=32, bits=4)
    lin.apply(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)
    form = native.to_native(lin)
    assert isinstance(form, native.NativeQuantizedLinear) and form["weight"] is lin["weight"]  # nothing copied
    x = mx.random.normal((5, 128))
    assert mx.allclose(form(x), lin(x), rtol=1e-5, atol=1e-4)
    assert mx.allclose(form(x.astype(mx.float16)).astype(mx.float32), lin(x.astype(mx.float16)).astype(mx.float32),
                       rtol=1e-2, atol=1e-2)  # MLX's own kernel, as before
    assert native.to_native(nn.QuantizedLinear(128, 64, group_size=32, bits=3)) is None


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("native") / "q4", "llama", seed=9, quantize_bits=4,
                            layers=3, vocab_size=288)


@needs_kernel
def test_cpu_native_holds_the_stored_bytes_and_generates_as_cpu_compact(q4_dir):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    compact = Engine(str(q4_dir), config=EngineConfig(policy="cpu-compact"))
    fast = Engine(str(q4_dir), config=EngineConfig(policy="cpu-native"))
    assert fast.swap.registry.resident_bytes() <= compact.swap.registry.resident_bytes()
    prompts = ["one two three", "a b c d e f g h i j"]
    for p in prompts:
        a = [c.token for c in compact.generate(p, sp) if c.token is not None]
        b = [c.token for c in fast.generate(p, sp) if c.token is not None]
        assert a == b


def test_without_the_kernel_the_native_form_is_mlx_s_own(q4_dir, monkeypatch):
    monkeypatch.setattr(native, "kernels", lambda: None)
    assert not native.available()
    lin = nn.QuantizedLinear(64, 32, group_size=32, bits=4)
    form = native.to_native(lin)
    x = mx.random.normal((2, 64))
    assert mx.allclose(form(x), lin(x))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = [c.token for c in Engine(str(q4_dir), config=EngineConfig(policy="cpu-native")).generate("x y z", sp)]
    b = [c.token for c in Engine(str(q4_dir), config=EngineConfig(policy="cpu-compact")).generate("x y z", sp)]
    assert [c for c in a if c is not None] == [c for c in b if c is not None]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 9])
def test_the_split_product_sums_each_widths_channels_in_one_operation(rows):
    """Keys stored per channel at several widths (kvexec/allocated.py): one operation is
    the sum of each width's product on the query's matching channels."""
    import numpy as np

    heads, dim, tokens = 3, 64, 384
    x = mx.random.normal((2, heads, rows, dim), key=mx.random.key(rows))
    order = np.stack([np.random.default_rng(h).permutation(dim) for h in range(heads)]).astype(np.int32)
    parts = [(8, order[:, :9]), (6, order[:, 9:30]), (5, order[:, 30:41]), (3, order[:, 41:60]), (2, order[:, 60:])]
    ws, scales, biases, columns, want = [], [], [], [], 0
    for i, (bits, cols) in enumerate(parts):
        w, s, b = mx.quantize(mx.random.normal((2, heads, cols.shape[1], tokens), key=mx.random.key(i)), 128, bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        picked = mx.take_along_axis(x, mx.array(cols)[None, :, None, :], axis=-1)
        want = want + mx.quantized_matmul(picked, w, s, b, transpose=False, group_size=128, bits=bits)
        ws.append(w), scales.append(s), biases.append(b), columns.append(mx.array(cols))
    got = native.kernels().quantized_matmul_rows_split(x, ws, scales, biases, columns, 128, [p[0] for p in parts])
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4 * float(mx.abs(want).max()))
    with pytest.raises(ValueError, match="one w, scales, biases and bits"):
        native.kernels().quantized_matmul_rows_split(x, ws, scales, biases, columns, 128, [8])


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 8, 300, 9000])
def test_the_native_softmax_equals_mlx_s_precise_one(n):
    """Decode attention's softmax over every score of a layer (kvexec.attention): MLX's
    values within float32 rounding, rows with masked (-inf) scores included, and what
    KVExec's decode attention gives is unchanged by it."""
    ext = native.kernels()
    x = mx.random.normal((2, 3, 5, n), key=mx.random.key(n)) * 12
    want = mx.softmax(x, axis=-1, precise=True)
    got = ext.softmax(x)
    assert got.shape == x.shape and mx.allclose(got, want, rtol=2e-5, atol=1e-7)
    assert mx.allclose(got.sum(axis=-1), mx.ones(got.shape[:-1]), atol=1e-5)
    masked = mx.where(mx.arange(n) % 3 == 1, -mx.inf, x)  # every third score invisible
    assert mx.allclose(ext.softmax(masked), mx.softmax(masked, axis=-1, precise=True), rtol=2e-5, atol=1e-7)
    assert mx.allclose(ext.softmax(x[..., ::2]), want[..., ::2] / want[..., ::2].sum(axis=-1, keepdims=True),
                       rtol=2e-5, atol=1e-7)  # a strided view is read as its values
    with pytest.raises(ValueError, match="float32"):
        ext.softmax(x.astype(mx.float16))


@needs_kernel
def test_sibling_projections_compute_as_one_operation_with_each_s_own_product():
    """A layer's q/k/v (gate/up) of one input: one operation with an output each, equal
    to each projection's own product, whatever each one's width (a GGUF's q and k in Q5_0,
    v in Q8_0); a new input recomputes; unlike siblings stay apart."""
    def linear(out, bits=4, inp=128, group=32):
        mod = nn.QuantizedLinear(inp, out, bias=False, group_size=group, bits=bits)
        mod.weight, mod.scales, mod.biases = mx.quantize(mx.random.normal((out, inp)), group, bits)
        return native.to_native(mod, 16)

    layer = nn.Module()
    layer.q_proj, layer.k_proj, layer.v_proj = linear(96, bits=5), linear(32, bits=5), linear(32, bits=8)
    layer.gate_proj, layer.up_proj = linear(64), linear(64, group=64)  # different groups: not joined
    own = {n: native._matvec for n in ("q_proj", "k_proj", "v_proj")}
    assert native.join_siblings(layer) == 1
    mx.eval(layer.parameters())
    for seed in (1, 2):
        x = mx.random.normal((1, 3, 128), key=mx.random.key(seed))
        mx.eval(x)
        q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
        graph = _graph(q)
        assert graph.count("JustFitQuantizedMatvec") == 1 and graph.count("rank=sink") == 3  # one op, 3 outputs
        for name, y in zip(own, (q, k, v)):
            assert mx.array_equal(y, own[name](x, layer[name]))
    x = mx.random.normal((2, 128))
    assert mx.array_equal(layer.v_proj(x), native._matvec(x, layer.v_proj))  # any order, any sibling first
    assert mx.array_equal(layer.v_proj(x), native._matvec(x, layer.v_proj))  # asked twice: computed again
    assert "_joint" not in layer.gate_proj.__dict__


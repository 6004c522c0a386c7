"""KV page codecs by name: round-trip error bounds, exact bytes per position, and the
executor, trim, snapshot and pressure-ladder contracts for rotated affine codecs."""

import mlx.core as mx
import numpy as np
import pytest

from kvexec import KVConfig, PageStore, blockwise_attention, get_format
from kvexec.export import export_store, restore_store
from kvexec.affine import Codec
from kvexec.rotated import rotation

# Per-channel key groups need pages of a multiple of the group.
NAMED = ["k4crv4r", "k5cv4r", "k5crv4r64", "k6cv3r", "k6cv4", "k6c64v4r", "k5c128v3r64", "k8cv4r", "k4cv4r"]


def _outlier_data(shape, seed=0) -> mx.array:
    """Gaussian with a few large fixed channels, as real keys have."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    x[..., 3] *= 20
    x[..., 17] += 8
    return mx.array(x)


def _steps(codec: Codec, x: mx.array) -> mx.array:
    """Per value, the quantization step of its group: the affine round-trip bound (half
    a step for rounding, up to half a step more where MLX shifts the grid so that zero
    is a level)."""
    y = (x @ rotation(x.shape[1], x.shape[-1])) if codec.rotated else x
    if codec.per_channel:
        y = y.swapaxes(-1, -2)
    g = codec.group_size
    groups = y.reshape(*y.shape[:-1], y.shape[-1] // g, g)
    step = (groups.max(axis=-1, keepdims=True) - groups.min(axis=-1, keepdims=True)) / (2**codec.bits - 1)
    step = mx.broadcast_to(step, groups.shape).reshape(y.shape)
    return step.swapaxes(-1, -2) if codec.per_channel else step


@pytest.mark.parametrize("codec", [Codec(b, g, per_channel=c, rotated=r) for b in (3, 4, 5, 6) for g in (32, 64)
                                   for c in (False, True) for r in (False, True)], ids=repr)
def test_round_trip_error_within_one_step(codec):
    x = _outlier_data((1, 2, 128, 64))
    back = codec.decode(codec.encode(x))
    err = back - x
    if codec.rotated:  # the bound holds per coordinate in the rotated space; the rotation is orthogonal
        err = err @ rotation(2, 64)
    # fp16 scale and bias move the bound by a little: 2% of a step plus fp16 resolution
    bound = _steps(codec, x) * 1.02 + 1e-2 * float(mx.abs(x).max()) / 2**codec.bits
    assert bool((mx.abs(err) <= bound).all())


def test_rotation_spreads_a_channel_outlier():
    x = _outlier_data((1, 2, 128, 64))
    plain = Codec(4).decode(Codec(4).encode(x)) - x
    turned = Codec(4, rotated=True).decode(Codec(4, rotated=True).encode(x)) - x
    assert float((turned**2).mean()) < 0.5 * float((plain**2).mean())


@pytest.mark.parametrize("name", NAMED)
def test_bytes_per_position_equal_theory(name):
    fmt = get_format(name)
    store = PageStore(KVConfig(format=name, page_size=128, hot_window=0, sink_tokens=0, block_tokens=256))
    x = _outlier_data((1, 3, 128 * 4, 64))  # segments of 128, 128, 256: all full
    store.append(x, x)
    assert store.pages == 4 and store.page_bytes() == 4 * 128 * fmt.bytes_per_token(3, 64)
    kb, vb = fmt.keys, fmt.values
    theory = (kb.bits + 32 / kb.group_size + vb.bits + 32 / vb.group_size) / 2  # fp16 scale + bias per group
    assert fmt.bits_per_value(3, 64) == pytest.approx(theory)


@pytest.mark.parametrize("name", ["k4crv4r", "k6cv3r", "k5crv4r64"])
@pytest.mark.parametrize("queries", [1, 40])  # scored on the stored form; decoded blocks
def test_executor_matches_attention_over_the_decoded_pages(name, queries):
    store = PageStore(KVConfig(format=name, page_size=64, hot_window=8, sink_tokens=2, block_tokens=128))
    k, v = _outlier_data((1, 3, 300, 64), 1), _outlier_data((1, 3, 300, 64), 2)
    store.append(k, v)
    held_k = mx.concatenate([b.fmt.keys.decode(b.keys) for b in store.blocks()], axis=2)
    held_v = mx.concatenate([b.fmt.values.decode(b.values) for b in store.blocks()], axis=2)
    q = mx.random.normal((1, 9, queries, 64), key=mx.random.key(queries))
    out = blockwise_attention(q, store.blocks(q), store.offset - queries, 0.125)
    qpos, kpos = mx.arange(store.offset - queries, store.offset)[:, None], mx.arange(store.offset)[None]
    ref = mx.fast.scaled_dot_product_attention(q, held_k, held_v, scale=0.125, mask=kpos <= qpos)
    assert float(mx.abs(out - ref).max()) < 2e-4 * float(mx.abs(ref).max())


@pytest.mark.parametrize("full_bits, bound", [(32, 1e-4), (16, 2e-3)])
def test_trim_snapshot_and_pressure_keep_rotated_pages(full_bits, bound):
    cfg = KVConfig(format="k6cv4r", page_size=64, hot_window=8, sink_tokens=2, block_tokens=128,
                   pressure=("k4crv4r", "k4crv3r"), full_bits=full_bits)
    store = PageStore(cfg)
    x = _outlier_data((1, 3, 400, 64), 3)
    store.append(x, x)
    q = mx.random.normal((1, 9, 1, 64))
    before = blockwise_attention(q, store.blocks(q), 199, 0.125)  # position 199 sees 0..199
    store.trim(200)
    assert store.offset == 200
    # trimmed pages come back into the hot window as attention saw them, in its precision
    # (float16 by default: its rounding, about 5e-4 of a value, is the bound)
    after = blockwise_attention(q, store.blocks(q), 199, 0.125)
    assert float(mx.abs(after - before).max()) < bound * float(mx.abs(before).max())
    store.append(x[..., 200:, :], x[..., 200:, :])
    limit = int(0.8 * store.page_bytes())
    store.limit(limit)  # steps the oldest pages down the ladder
    assert store.page_bytes() <= limit and set(store.formats()) - {"k6cv4r"}
    arrays, meta = export_store(store)
    back = restore_store(arrays, meta)
    assert back.formats() == store.formats()
    a = blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125)
    assert mx.array_equal(a, blockwise_attention(q, back.blocks(q), back.offset - 1, 0.125))


def test_named_formats_parse_and_refuse_bad_names():
    fmt = get_format("k5cr128v3r64")
    assert fmt.keys == Codec(5, 128, per_channel=True, rotated=True) and fmt.values == Codec(3, 64, rotated=True)
    assert get_format("k8cv4") == get_format("k8cv4")  # the fixed names keep their meaning
    with pytest.raises(ValueError, match="bits must be"):
        get_format("k7cv4")
    with pytest.raises(ValueError, match="unknown KV format"):
        get_format("k5x")
    assert not get_format("k4crv4r").supports_head_dim(96)  # Hadamard rotations need a power of two
    with pytest.raises(ValueError, match="multiple of 128"):
        PageStore(KVConfig(format="k5c128v4", page_size=64, block_tokens=128))

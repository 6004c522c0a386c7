"""Allocated keys (a calibrated bit width per channel): the allocation rule, the codec's
round-trip bound and exact bytes, scores on the stored form, names, and the store's
contracts (executor, trim, snapshot, pressure ladder) with allocated pages."""

import mlx.core as mx
import numpy as np
import pytest

from kvexec import KVConfig, PageStore, blockwise_attention, get_format
from kvexec.allocated import WIDTHS, AllocatedCodec, allocate_widths, channel_weights, widths_text
from kvexec.export import export_store, restore_store


def _weights(heads=3, dim=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0.0, 2.0, size=(heads, dim))


def _keys(weights: np.ndarray, tokens: int, seed=1) -> mx.array:
    """Keys whose channel c ranges like sqrt(weights[c]) (queries of unit energy)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, *weights.shape[:1], tokens, weights.shape[1])) * np.sqrt(weights)[None, :, None, :]
    return mx.array(x.astype(np.float32))


def _name(weights, mean=5, group=128, values="v4r64") -> str:
    return f"k{mean}a{group}{values}~{widths_text(allocate_widths(weights, mean))}"


@pytest.mark.parametrize("mean", [3, 4, 5, 6])
def test_allocation_spends_the_mean_exactly_and_favours_heavy_channels(mean):
    w = _weights()
    widths = allocate_widths(w, mean)
    assert allocate_widths(w, mean) == widths  # deterministic
    for h, head in enumerate(widths):
        assert sum(head) == mean * len(head) and set(head) <= set(WIDTHS)
        assert sorted(head) == sorted(widths[0])  # the same channels at each width in every head
        order = np.argsort(-w[h], kind="stable")
        assert [head[c] for c in order] == sorted(head, reverse=True)  # heavier channel, no fewer bits
    assert len(set(widths[0])) > 1  # weights spread over 2+ orders of magnitude: widths differ


def test_allocation_beats_equal_widths_on_the_score_error():
    w = _weights()
    x = _keys(w, 512)  # with unit-energy queries, a score's error is the keys' summed squared error
    allocated, uniform = get_format(_name(w)).keys, get_format("k5c128v4r64").keys
    squared = lambda codec: float(((codec.decode(codec.encode(x)) - x) ** 2).sum())  # noqa: E731
    assert squared(allocated) < 0.6 * squared(uniform)  # the same bytes, where they count


def test_round_trip_within_one_step_per_channel_width():
    w = _weights(seed=2)
    codec = get_format(_name(w)).keys
    x = _keys(w, 256)
    err = mx.abs(codec.decode(codec.encode(x)) - x)
    groups = x.reshape(1, 3, 2, 128, 64)
    rng = mx.broadcast_to((groups.max(axis=3, keepdims=True) - groups.min(axis=3, keepdims=True)),
                          groups.shape).reshape(x.shape)
    bits = mx.array(np.array(codec.widths, dtype=np.float32))[None, :, None, :]
    step = rng / (2**bits - 1)
    # half a step for rounding, up to half more where MLX shifts the grid so that zero is
    # a level (a few percent past one step at 2-3 bits), and fp16 scales and biases
    assert bool((err <= step * 1.05 + 1e-3 * float(mx.abs(x).max()) / 2**bits).all())


@pytest.mark.parametrize("mean,group", [(4, 128), (5, 64), (6, 32)])
def test_bytes_per_position_equal_theory(mean, group):
    w = _weights(seed=3)
    fmt = get_format(_name(w, mean, group))
    store = PageStore(KVConfig(format=fmt.name, page_size=128, hot_window=0, sink_tokens=0, block_tokens=256))
    x = _keys(w, 128 * 4)
    store.append(x, x)
    assert store.pages == 4 and store.page_bytes() == 4 * 128 * fmt.bytes_per_token(3, 64)
    values = fmt.values.bits + 32 / fmt.values.group_size
    assert fmt.bits_per_value(3, 64) == pytest.approx((mean + 32 / group + values) / 2)
    assert fmt.label == f"k{mean}a{group}v4r64"


@pytest.mark.parametrize("rows", [1, 7, 40])  # the native rows product; MLX's product; decoded blocks
def test_scores_on_the_stored_form_equal_scores_on_the_decoded_keys(rows):
    w = _weights(seed=4)
    codec = get_format(_name(w)).keys
    enc = codec.encode(_keys(w, 256))
    q = mx.random.normal((1, 3, rows, 64), key=mx.random.key(rows))
    ref = q @ codec.decode(enc).swapaxes(-1, -2)
    assert float(mx.abs(codec.scores(q, enc) - ref).max()) < 1e-4 * float(mx.abs(ref).max())


@pytest.mark.parametrize("queries", [1, 40])
def test_executor_trim_snapshot_and_pressure_with_allocated_pages(queries):
    w = _weights(seed=5)
    name = _name(w, group=64)
    store = PageStore(KVConfig(format=name, page_size=64, hot_window=8, sink_tokens=2, block_tokens=128,
                               pressure=("q4c", "q3c")))
    k, v = _keys(w, 400, 6), _keys(w, 400, 7)
    store.append(k, v)
    held_k = mx.concatenate([b.fmt.keys.decode(b.keys) for b in store.blocks()], axis=2)
    held_v = mx.concatenate([b.fmt.values.decode(b.values) for b in store.blocks()], axis=2)
    q = mx.random.normal((1, 9, queries, 64), key=mx.random.key(queries)) * 0.05
    out = blockwise_attention(q, store.blocks(q), store.offset - queries, 0.125)
    qpos, kpos = mx.arange(store.offset - queries, store.offset)[:, None], mx.arange(store.offset)[None]
    ref = mx.fast.scaled_dot_product_attention(q, held_k, held_v, scale=0.125, mask=kpos <= qpos)
    assert float(mx.abs(out - ref).max()) < 2e-4 * float(mx.abs(ref).max())
    one = q[:, :, :1]
    before = blockwise_attention(one, store.blocks(one), 199, 0.125)
    store.trim(200)
    assert float(mx.abs(blockwise_attention(one, store.blocks(one), 199, 0.125) - before).max()) < 1e-4
    store.append(k[..., 200:, :], v[..., 200:, :])
    limit = int(0.8 * store.page_bytes())
    store.limit(limit)  # the oldest pages step down the ladder, re-encoded from the allocated keys
    assert store.page_bytes() <= limit and set(store.formats()) - {name}
    back = restore_store(*export_store(store))  # pages as stored: the widths travel in the format's name
    assert back.formats() == store.formats()
    a = blockwise_attention(one, store.blocks(one), store.offset - 1, 0.125)
    assert mx.array_equal(a, blockwise_attention(one, back.blocks(one), back.offset - 1, 0.125))


def test_names_refuse_widths_that_do_not_match():
    w = _weights()
    good = _name(w)
    assert get_format(good).keys == AllocatedCodec(allocate_widths(w, 5), 128)
    prefix, _, text = good.partition("~")
    with pytest.raises(ValueError, match="average"):
        get_format(f"k4a128v4r64~{text}")
    heads = text.split(".")
    with pytest.raises(ValueError, match="same number"):
        get_format(f"{prefix}~{heads[0]}.{'5' * 64}.{heads[2]}")
    with pytest.raises(ValueError, match="among"):
        AllocatedCodec(((7,) * 64,))
    with pytest.raises(ValueError, match="calibrate it first"):
        get_format("k5a128v4r64")  # an allocated format before calibration chose its widths
    assert not get_format(good).supports_head_dim(128)
    with pytest.raises(ValueError, match="allocated keys for 3 x 64"):
        get_format(good).keys.encode(mx.zeros((1, 2, 128, 64)))


def test_channel_weights_follow_query_energy_and_key_range():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(6, 256, 64)).astype(np.float32)
    k = rng.normal(size=(2, 256, 64)).astype(np.float32)
    q[:, :, 5] *= 10  # loud queries on channel 5
    k[:, :, 9] *= 10  # wide keys on channel 9
    w = channel_weights(q, k, 128)
    assert w.shape == (2, 64)
    assert np.argsort(-w[0])[:2].tolist() in ([5, 9], [9, 5])

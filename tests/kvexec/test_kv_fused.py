"""Decode attention as one native operation (kvexec/fused.py, native/decode_attention.cpp):
the same output as the two-pass MLX path for every page layout it takes (per-channel
keys, allocated keys, rotated keys and values, full-precision sinks and hot window),
partly visible blocks (sliding windows, several queries), batches, partly written
segments; one operation a layer; layouts it cannot take fall back."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from kvexec import KVConfig, PageStore, blockwise_attention
from kvexec import attention
from kvexec.allocated import allocate_widths, widths_text
from kvexec.fused import fused_attention
from kvexec.rotated import rotation, rotation_pair
from phaseswap import native

pytestmark = pytest.mark.skipif(not hasattr(native.kernels(), "decode_attention") if native.available() else True,
                                reason="native kernels not built here, or off (JUSTFIT_NATIVE=0); ./dev setup builds them")

HEADS, KV_HEADS, DIM = 9, 3, 64


def _allocated() -> str:
    weights = np.random.default_rng(0).lognormal(0.0, 2.0, size=(KV_HEADS, DIM))
    return f"k5a128v4r64~{widths_text(allocate_widths(weights, 5))}"


def _store(fmt: str, positions: int, batch: int = 1, window: int | None = None, seed: int = 0) -> PageStore:
    store = PageStore(KVConfig(format=fmt), window)
    key = mx.random.key(seed)
    done = 0
    while done < positions:  # uneven appends: partly written segments, a hot window of any length
        n = min(positions - done, 97 if done % 2 else 300)
        k1, k2, key = mx.random.split(key, 3)
        store.append(mx.random.normal((batch, KV_HEADS, n, DIM), key=k1) * 2,
                     mx.random.normal((batch, KV_HEADS, n, DIM), key=k2))
        mx.eval(store.arrays())
        done += n
    return store


def _two_pass(queries, store, window=None):
    L = queries.shape[-2]
    blocks = list(store.blocks(queries))
    return attention._two_pass(queries, blocks, store.offset - L, 0.125, window, None, None)


def _fused(queries, store, window=None):
    L = queries.shape[-2]
    q_start = store.offset - L
    blocks = [b for b in store.blocks(queries) if attention._sees(q_start, L, b.start, b.length, window)]
    return fused_attention(queries, blocks, q_start, 0.125, window)


@pytest.mark.parametrize("fmt", ["q8c", "q4c", "k8cv4r", "k6crv4", "k3cv2", "fp32", "ALLOCATED"])
@pytest.mark.parametrize("positions", [40, 1500])
def test_one_operation_equals_the_two_pass_path(fmt, positions):
    fmt = _allocated() if fmt == "ALLOCATED" else fmt
    store = _store(fmt, positions)
    q = mx.random.normal((1, HEADS, 1, DIM), key=mx.random.key(7))
    got, want = _fused(q, store), _two_pass(q, store)
    assert got is not None and got.shape == want.shape == q.shape
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5), float(mx.abs(got - want).max())


@pytest.mark.parametrize("batch,queries,window", [(2, 1, None), (1, 3, None), (1, 1, 700), (2, 2, 650)])
def test_masks_windows_and_batches_as_the_two_pass_path(batch, queries, window):
    store = _store("q8c", 2000, batch=batch, window=window)
    q = mx.random.normal((batch, HEADS, queries, DIM), key=mx.random.key(3))
    got, want = _fused(q, store, window), _two_pass(q, store, window)
    assert got is not None
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5), float(mx.abs(got - want).max())


def test_a_layer_s_attention_is_one_operation_and_reads_pages_in_place():
    store = _store("q8c", 1500)
    q = mx.random.normal((1, HEADS, 1, DIM))
    mx.eval(q)
    out = blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125)
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    ops = [line.split('label ="')[1].split('"')[0] for line in dot.getvalue().splitlines() if 'label ="' in line]
    assert ops == ["JustFitDecodeAttention"]  # no slices of partly written segments, no copies


def test_what_it_cannot_take_falls_back_to_mlx_operations():
    store = _store("r4", 600)  # rotated codebook pages
    q = mx.random.normal((1, HEADS, 1, DIM))
    assert _fused(q, store) is None
    assert _fused(q.astype(mx.float16), _store("q8c", 600)) is None
    out = blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125)
    assert mx.allclose(out, _two_pass(q, store), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (10, 2, 48), (3, 3, 32)])
def test_full_blocks_values_for_any_rows_a_head_and_width(heads, kv_heads, dim):
    """Full-precision values are weighted several query rows at a time (3, then the rest)
    over 32-wide spans of the head, a narrower tail one row at a time."""
    store = PageStore(KVConfig(format="fp32"))
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    store.append(mx.random.normal((1, kv_heads, 300, dim), key=k1), mx.random.normal((1, kv_heads, 300, dim), key=k2))
    q = mx.random.normal((1, heads, 1, dim), key=k3)
    got, want = _fused(q, store), _two_pass(q, store)
    assert got is not None
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5), float(mx.abs(got - want).max())


@pytest.mark.parametrize("fmt", ["q8c", "k8cv4r"])
def test_sinks_and_hot_window_in_float16_halve_their_bytes_and_read_in_one_operation(fmt):
    """KVConfig.full_bits 16 (the default) keeps float32 tokens in float16: the kernel
    reads them as stored and matches the two-pass path, and the error against exact
    attention is the pages' own (float16's rounding moves a page's per-channel range,
    so its codes differ from full_bits 32's, but not its error). Float32 pages keep
    float32 tokens."""
    stores, keys, values = {}, [], []
    for bits in (16, 32):
        stores[bits] = PageStore(KVConfig(format=fmt, full_bits=bits))
        key, keys, values = mx.random.key(11), [], []
        for n in (300, 97, 250):
            k1, k2, key = mx.random.split(key, 3)
            keys.append(mx.random.normal((1, KV_HEADS, n, DIM), key=k1) * 2)
            values.append(mx.random.normal((1, KV_HEADS, n, DIM), key=k2))
            stores[bits].append(keys[-1], values[-1])
        mx.eval(stores[bits].arrays())
    half, full = stores[16], stores[32]
    assert half.hot_k.dtype == half.sink_k.dtype == mx.float16 and full.hot_k.dtype == mx.float32
    assert half.hot.keys_room.nbytes * 2 == full.hot.keys_room.nbytes
    q = mx.random.normal((1, HEADS, 4, DIM), key=mx.random.key(2))
    got = _fused(q, half)
    assert got is not None and mx.allclose(got, _two_pass(q, half), rtol=1e-4, atol=1e-5)
    n = half.offset
    exact = mx.fast.scaled_dot_product_attention(q, mx.concatenate(keys, axis=-2), mx.concatenate(values, axis=-2),
                                                 scale=0.125, mask=mx.arange(n - 4, n)[:, None] >= mx.arange(n)[None])
    error = {bits: float(mx.abs(_fused(q, s) - exact).mean()) for bits, s in stores.items()}
    assert error[16] < 1.15 * error[32], error
    fp32 = PageStore(KVConfig(format="fp32"))
    fp32.append(mx.ones((1, KV_HEADS, 8, DIM)), mx.ones((1, KV_HEADS, 8, DIM)))
    assert fp32.hot_k.dtype == fp32.sink_k.dtype == mx.float32


def test_the_rotation_goes_with_its_transpose_made_once():
    pair = rotation_pair(KV_HEADS, DIM)
    r = rotation(KV_HEADS, DIM)
    assert pair.shape == (2, KV_HEADS, DIM, DIM) and rotation_pair(KV_HEADS, DIM) is pair
    assert mx.array_equal(pair[0], r) and mx.array_equal(pair[1], r.swapaxes(-1, -2))
    ext = native.kernels()
    q, k = mx.random.normal((1, HEADS, 1, DIM)), mx.random.normal((1, KV_HEADS, 8, DIM))
    with pytest.raises(ValueError, match=r"\[2, kv_heads, D, D\]"):
        ext.decode_attention(q, [k, k], [[0, 0, 8]], 8, 0.125, 0, r)


def test_the_kernel_refuses_arrays_that_do_not_match_the_blocks():
    ext = native.kernels()
    q = mx.random.normal((1, HEADS, 1, DIM))
    k = mx.random.normal((1, KV_HEADS, 8, DIM))
    with pytest.raises(ValueError, match="do not match"):
        ext.decode_attention(q, [k], [[0, 0, 8]], 8, 0.125, 0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ext.decode_attention(mx.random.normal((1, 4, 1, DIM)), [k, k], [[0, 0, 8]], 8, 0.125, 0)
    with pytest.raises(ValueError, match="float32"):
        ext.decode_attention(q, [k.astype(mx.float16), k], [[0, 0, 8]], 8, 0.125, 0)


def test_the_hot_window_takes_a_decode_token_in_place_and_keeps_its_tokens():
    """A decode step writes its token into the hot window's room (a slice update, no
    concatenation of the window), never into a room someone else still holds; flushes
    and trims keep exactly the tokens held."""
    store = _store("q8c", 600)
    held, n = store.hot_k, store.hot.n
    view = store.hot.keys_room[..., : n + 1, :]  # a view that reaches the next token's place
    before = mx.array(view[..., n:, :])
    mx.eval(held, view, before)
    k = mx.random.normal((1, KV_HEADS, 1, DIM))
    mx.eval(k)
    store.append(k, k)
    dot = io.StringIO()
    mx.export_to_dot(dot, store.hot.keys_room)
    assert "Concatenate" not in dot.getvalue() and "SliceUpdate" in dot.getvalue()
    assert store.hot_k.dtype == mx.float16  # float32 activations' tokens at half the bytes
    assert mx.array_equal(store.hot_k, mx.concatenate([held, k.astype(mx.float16)], axis=-2))
    assert mx.array_equal(view[..., n:, :], before)  # the room a view holds was copied, not written
    for _ in range(600):  # through a flush into a page
        store.append(k, k)
    mx.eval(store.arrays())
    assert store.retained() == store.offset == 1201 and store.hot.n == store.hot_k.shape[-2] < 512
    assert store.trim(300) == 300 and store.retained() == 901
    assert store.hot_k.shape[-2] == store.hot.n and store.hot_v.shape == store.hot_k.shape


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("fmt", ["q8c", "fp32"])
def test_prefill_s_native_softmax_step_equals_the_mlx_path(window, fmt, monkeypatch):
    """A prefill chunk's online softmax (mask, max, exponentials, row sums) as one native
    operation per block gives what MLX's operations and numpy's exponentials give."""
    store = _store(fmt, 1400, window=window)
    q = mx.random.normal((1, HEADS, 200, DIM), key=mx.random.key(11))
    args = (q, list(store.blocks()), store.offset - 200, 0.125, window)
    native_out = blockwise_attention(*args, block_tokens=512)
    monkeypatch.setattr(attention, "rows_kernel", lambda: None)
    assert mx.allclose(native_out, blockwise_attention(*args, block_tokens=512), rtol=1e-4, atol=1e-5)


def test_the_softmax_step_kernel_masks_as_told():
    ext = native.kernels()
    s = mx.random.normal((1, 2, 6, 10))  # 2 heads' rows: 3 queries x rep 2
    m = mx.full((1, 2, 6, 1), -mx.inf)
    p, corr, m_new, rows = ext.softmax_step(s, m, 3, 7, 5, 4)  # queries at 7..9, keys at 5..14, window 4
    q_pos = mx.array([7, 8, 9] * 2)[:, None]
    k_pos = mx.arange(5, 15)[None]
    visible = (k_pos <= q_pos) & (q_pos - k_pos < 4)
    top = mx.where(visible, s, -mx.inf).max(axis=-1, keepdims=True)
    want = mx.where(visible, mx.exp(s - top), 0)
    assert mx.allclose(p, want, atol=1e-6) and mx.allclose(rows, want.sum(axis=-1, keepdims=True), atol=1e-5)
    assert mx.array_equal(m_new, top) and mx.array_equal(corr, mx.zeros_like(corr))
    with pytest.raises(ValueError, match="multiple of L"):
        ext.softmax_step(s, m, 4, 7, 5, 4)

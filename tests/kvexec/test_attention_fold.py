"""Prefill's attention over a block as one native operation (native/attention_fold.cpp):
the running max, sum and accumulator after a block equal what the softmax step and
MLX's products give, for causal and windowed masks, rows that have seen nothing yet,
blocks of any length and head sizes of 32 to 256; KVExec's prefill takes it; what it
cannot take is refused (and the MLX path runs)."""

from __future__ import annotations

import io

import mlx.core as mx
import pytest

from kvexec import KVConfig, PageStore, blockwise_attention, transient_bytes
from phaseswap import native

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.kernels(), "attention_fold"),
                                reason="native kernels not built here, or off (JUSTFIT_NATIVE=0); ./dev setup builds them")


def _reference(q, k, v, m, l, acc, L, q_start, k_start, window):
    p, corr, m_new, rows = native.kernels().softmax_step(q @ k.swapaxes(-1, -2), m, L, q_start, k_start, window)
    return m_new, l * corr + rows, acc * corr + p @ v


def _state(shape, seed):
    """A running state part way through: some rows with nothing visible yet (-inf, 0, 0)."""
    key = mx.random.key(seed)
    m = mx.random.normal((*shape[:3], 1), key=key)
    m = mx.where(mx.random.uniform(shape=m.shape, key=mx.random.split(key)[0]) < 0.3, -mx.inf, m)
    l = mx.where(m == -mx.inf, 0.0, mx.abs(mx.random.normal(m.shape, key=key)) + 1)
    acc = mx.where(m == -mx.inf, 0.0, mx.random.normal(shape, key=key))
    return m, l, acc


@pytest.mark.parametrize("B,kvh,L,rep,D,n,q_start,k_start,window", [
    (1, 3, 37, 3, 64, 100, 60, 0, 0),      # causal, blocks not a multiple of the tiles
    (1, 3, 512, 3, 64, 1024, 512, 0, 0),   # a 1K prompt's second chunk
    (2, 1, 20, 4, 256, 70, 30, 5, 16),     # Gemma's head size, a sliding window, a batch
    (1, 2, 5, 2, 32, 300, 400, 0, 0),      # every key visible
    (1, 1, 8, 1, 64, 64, 0, 100, 0),       # no key visible: the state passes through
])
def test_the_fold_equals_the_softmax_step_and_products(B, kvh, L, rep, D, n, q_start, k_start, window):
    key = mx.random.key(n + D)
    q = mx.random.normal((B, kvh, rep * L, D), key=key) * 0.3
    k, v = (mx.random.normal((B, kvh, n, D), key=s) for s in mx.random.split(key))
    m, l, acc = _state(q.shape, n)
    got = native.kernels().attention_fold(q, k, v, m, l, acc, L, q_start, k_start, window)
    for a, b in zip(got, _reference(q, k, v, m, l, acc, L, q_start, k_start, window)):
        assert mx.array_equal(a == -mx.inf, b == -mx.inf)
        a, b = mx.where(a == -mx.inf, 0, a), mx.where(b == -mx.inf, 0, b)
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5 * float(mx.abs(b).max()))


def test_the_fold_refuses_what_it_cannot_take():
    ext = native.kernels()
    q = mx.zeros((1, 1, 4, 24))
    m, l = mx.zeros((1, 1, 4, 1)), mx.zeros((1, 1, 4, 1))
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.attention_fold(q, mx.zeros((1, 1, 8, 24)), mx.zeros((1, 1, 8, 24)), m, l, q, 4, 0, 0, 0)
    q = mx.zeros((1, 1, 4, 32))
    with pytest.raises(ValueError, match="k and v"):
        ext.attention_fold(q, mx.zeros((1, 1, 8, 32)), mx.zeros((1, 1, 9, 32)), m, l, q, 4, 0, 0, 0)
    with pytest.raises(ValueError, match="multiple of L"):
        ext.attention_fold(q, mx.zeros((1, 1, 8, 32)), mx.zeros((1, 1, 8, 32)), m, l, q, 3, 0, 0, 0)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("fmt", ["q8c", "k8cv4r"])
def test_prefill_attention_takes_the_fold(window, fmt, monkeypatch):
    store = PageStore(KVConfig(format=fmt), window)
    for seed in range(3):
        k1, k2 = mx.random.split(mx.random.key(seed))
        store.append(mx.random.normal((1, 3, 450, 64), key=k1) * 2, mx.random.normal((1, 3, 450, 64), key=k2))
    q = mx.random.normal((1, 9, 200, 64), key=mx.random.key(7))
    args = (q, list(store.blocks()), store.offset - 200, 0.125, window)
    folded = blockwise_attention(*args, block_tokens=512)
    dot = io.StringIO()
    mx.export_to_dot(dot, folded)
    assert "JustFitAttentionFold" in dot.getvalue() and "JustFitSoftmaxStep" not in dot.getvalue()
    monkeypatch.delattr(native.kernels(), "attention_fold")
    assert mx.allclose(folded, blockwise_attention(*args, block_tokens=512), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fold", [True, False])
def test_the_planner_counts_what_prefill_attention_holds(fold, monkeypatch):
    # SmolLM2's shape: a 128-row chunk after 4,096 positions in q8c pages, 2,048-key blocks
    if not fold:
        monkeypatch.delattr(native.kernels(), "attention_fold")
    store = PageStore(KVConfig(format="q8c"), None)
    for seed in range(2):
        k1, k2 = mx.random.split(mx.random.key(seed))
        store.append(mx.random.normal((1, 3, 2048, 64), key=k1), mx.random.normal((1, 3, 2048, 64), key=k2))
    q = mx.random.normal((1, 9, 128, 64), key=mx.random.key(7))
    blocks = list(store.blocks())
    mx.eval(q, *[a for b in blocks for a in (*b.keys.values(), *b.values.values())])
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = blockwise_attention(q, blocks, store.offset - 128, 0.125, block_tokens=2048)
    mx.eval(out)
    held = mx.get_peak_memory() - before - out.nbytes - q.nbytes  # less the result and the scaled queries
    counted = transient_bytes(128, store.offset, 9, 3, 64, 2048)
    assert 0 < held <= counted
    assert counted < (4 if fold else 2) * held  # and not far above it
    if fold:  # the block's scores never exist whole: a third of what the unfolded path holds
        monkeypatch.delattr(native.kernels(), "attention_fold")
        assert 3 * counted < transient_bytes(128, store.offset, 9, 3, 64, 2048)


def test_attention_over_no_positions():
    """The planner asks at 0 positions (a budget that holds none with the pages on disk):
    a decode row holds nothing, a chunk's rows only their running state, with and without
    row-invariant groups."""
    assert transient_bytes(1, 0, 9, 3, 64, 2048) == transient_bytes(1, 0, 9, 3, 64, 2048, row_invariant=True) == 0
    state = 2 * 9 * 128 * (64 + 2) * 4
    assert 0 < transient_bytes(128, 0, 9, 3, 64, 2048, row_invariant=True) <= 2 * state

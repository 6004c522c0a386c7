"""KVExec's strategies over the pages: retention (what a bounded store keeps, by policy)
and page selection (which pages a decode query attends to)."""

import mlx.core as mx
import numpy as np
import pytest

import kvexec
from kvexec import KVConfig, PageStore, blockwise_attention

RETAIN = dict(page_size=16, hot_window=8, sink_tokens=2, block_tokens=32)


def _decode_steps(store, n, heads=9, key=None, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        k = mx.array(rng.normal(size=(1, 3, 1, 64)).astype(np.float32)) if key is None else key
        store.append(k, k)
        q = mx.array(rng.normal(size=(1, heads, 1, 64)).astype(np.float32))
        cache_like = kvexec.PagedKVCache.__new__(kvexec.PagedKVCache)
        cache_like.store = store
        mx.eval(cache_like.attend(q, 0.125))


@pytest.mark.parametrize("policy", ["random", "score"])
def test_retention_holds_budget_and_keeps_prompt_sinks_and_hot(policy):
    store = PageStore(KVConfig(format="q4", max_positions=80, policy=policy, **RETAIN))
    prompt = mx.random.normal((1, 3, 40, 64))
    store.append(prompt, prompt)
    store.pinned = 40
    _decode_steps(store, 150)
    assert store.offset == 190 and store.retained() <= 80 and store.evicted > 0
    assert store.sink_k.shape[-2] == 2 and store._hot_len() >= 8
    kept = [s.start for s in store.segments]
    assert 2 in kept and 18 in kept  # the prompt's pages (positions 2..33) were never evicted
    assert not store.can_trim(50)  # evicted pages cannot come back


def test_score_policy_keeps_the_attended_page():
    store = PageStore(KVConfig(format="fp32", max_positions=70, policy="score", **RETAIN))
    store.pinned = 0
    rng = np.random.default_rng(3)
    q = mx.array(rng.normal(size=(1, 9, 1, 64)).astype(np.float32))
    magnet = mx.broadcast_to(q.reshape(1, 3, 3, 64).mean(axis=2, keepdims=True) * 4, (1, 3, 16, 64))
    noise = lambda n: mx.array(rng.normal(size=(1, 3, n, 64)).astype(np.float32)) * 0.1  # noqa: E731
    store.append(noise(18), noise(18))  # sinks + a first page
    store.append(magnet, magnet)  # positions 18..33: what the queries look for
    cache = kvexec.PagedKVCache.__new__(kvexec.PagedKVCache)
    cache.store = store
    for _ in range(120):
        x = noise(1)
        store.append(x, x)
        mx.eval(cache.attend(q, 0.125))
    assert store.evicted > 0
    assert any(s.start == 18 for s in store.segments)  # the attended page survived


def test_retention_budget_below_minimum_is_refused():
    with pytest.raises(ValueError, match="max_positions"):
        KVConfig(max_positions=10, page_size=16, hot_window=8, sink_tokens=2)


def test_page_selection_attends_to_the_pages_that_matter():
    rng = np.random.default_rng(5)
    cfg = dict(format="fp32", **RETAIN)
    full, picked = PageStore(KVConfig(**cfg)), PageStore(KVConfig(select_pages=2, **cfg))
    q = mx.array(rng.normal(size=(1, 9, 1, 64)).astype(np.float32))
    target = mx.broadcast_to(q.reshape(1, 3, 3, 64).mean(axis=2, keepdims=True) * 4, (1, 3, 16, 64))
    for i in range(12):
        x = target if i == 5 else mx.array(rng.normal(size=(1, 3, 16, 64)).astype(np.float32)) * 0.3
        v = mx.array(rng.normal(size=(1, 3, 16, 64)).astype(np.float32))
        full.append(x, v)
        picked.append(x, v)
    blocks = list(picked.blocks(q))
    assert len(blocks) < len(list(full.blocks(q)))
    assert any(b.start <= 88 < b.start + b.length for b in blocks)  # inside the target chunk
    a = blockwise_attention(q, full.blocks(q), full.offset - 1, 0.125)
    b = blockwise_attention(q, picked.blocks(q), picked.offset - 1, 0.125)
    assert float(mx.abs(a - b).max()) < 0.05

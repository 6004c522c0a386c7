"""Rolling back a speculative verify: a chunk of [pending token] + k draft tokens fed in
one pass (no larger than kvexec.chunk_room, so no page is written inside it), then
kvexec.trim of the rejected tail. On given keys and values the store is then bit for bit
the one that took only the accepted rows one at a time. Through a model the layout is
too, but a pass of k + 1 rows computes each row's keys, values and logits with other
sums than a one-row pass (matrix products and attention blocked by the row count), so
they agree to rounding, not bit for bit; a saved state restores the rolled-back cache
bit for bit.
Across the hot window alone, right after a page was written, sink tokens, sliding-window
layers and pages on disk; on tiny random-weight models with lossy pages (q8c), so a
trim that reached into a page would show."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes

import kvexec
from kvexec import KVConfig
from kvexec.disk_pages import PageFile, PageReader
from statetrans import capture, load_snapshot, rebuild, save_snapshot

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
             num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=97,
             rope_theta=10000.0, tie_word_embeddings=True)  # head_dim 32: q8c pages can hold it
GEMMA3 = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
              vocab_size=97, sliding_window=24, sliding_window_pattern=6, query_pre_attn_scalar=32)
SMALL = dict(format="q8c", page_size=32, hot_window=8, block_tokens=64)
# A key or value in the float16 hot window that reordering moved by one float16 ulp
# (2^-10 of it at most) moves the next token's logits by at most that share of their
# scale (attention averages the values with weights that sum to one). The differences
# seen per BLAS build: docs/ARCHITECTURE.md, numerics.
HOT_ULP = 2.0 ** -10
# How far a verify pass's logits may stand from one-token steps' in fp32 (u = 2^-24):
# row blocking reorders every reduction feeding a logit -- each projection's (<= 96
# terms), each attention's (<= 83 positions, 32 dimensions), the head's -- about 2^10
# sums along the chain of these models, each reordering worth up to its length times u,
# and the x4 weights and the norms amplify a hidden state's error up to 8 = 2^3: the logits
# agree to 24 - 13 = 11 bits of their scale. A verify step off by one position misses
# it by orders of magnitude (the test checks that too).
REORDERING = 2.0 ** (13 - 24)


_MODELS: dict[str, object] = {}


def _model(name: str):
    if name not in _MODELS:
        config = LLAMA if name == "llama" else GEMMA3
        mx.random.seed(0)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        model.apply(lambda a: (a * 4 if a.ndim == 2 else a).astype(mx.float32))  # sharper logits
        mx.eval(model.parameters())
        kvexec.install(model)
        _MODELS[name] = model
    return _MODELS[name]


@dataclass(frozen=True)
class Case:
    model: str
    prompt: int  # positions in the cache before the verify
    sinks: int = 0
    disk: bool = False
    exact: bool = False  # kvexec.keep_exact at the prompt's end, as a request sets it


CASES = {
    "hot window only": Case("llama", 10),
    "right after a page was written": Case("llama", 41),  # the first page went at 40: a segment half full
    "sinks, the chunk crossing their end": Case("llama", 2, sinks=4),
    "sinks and pages": Case("llama", 45, sinks=4),
    "sliding-window layers": Case("gemma3", 75, sinks=2),
    "pages on disk": Case("llama", 74, disk=True),  # a full segment (two pages) went to disk at 72
    "exact trim point kept": Case("llama", 57, exact=True),
}


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 97, n)]


def _step(model, cache: list, tokens: list[int]) -> mx.array:
    """Feed `tokens` in one pass; their logits [len(tokens), vocab] (fp32)."""
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _prefilled(case: Case, tmp_path, prompt: list[int]) -> tuple[list, PageReader | None]:
    model = _model(case.model)
    cache = kvexec.make_cache(model, KVConfig(sink_tokens=case.sinks, **SMALL))
    reader = None
    if case.disk:
        reader = PageReader()
        kvexec.spill_layers(cache, PageFile(tmp_path), reader, len(cache))
    for start in range(0, len(prompt), 19):  # chunks that straddle page writes
        _step(model, cache, prompt[start:start + 19])
    if case.exact:
        kvexec.keep_exact(cache, len(prompt))
    return cache, reader


def _held(cache: list) -> tuple[dict[str, mx.array], list[dict]]:
    """The cache's saved state; an empty hot window counts as none (a trim to the hot
    window's start leaves it empty where a store that never filled it has none)."""
    arrays, meta = capture(cache)
    return {k: a for k, a in arrays.items() if a.size}, meta


def _assert_same_state(a: list, b: list) -> None:
    (arrays_a, meta_a), (arrays_b, meta_b) = _held(a), _held(b)
    assert meta_a == meta_b
    assert arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        assert arrays_a[name].dtype == arrays_b[name].dtype, name
        assert mx.array_equal(arrays_a[name], arrays_b[name]).item(), name


def _same(x: mx.array, y: mx.array) -> bool:
    return x.shape == y.shape and mx.array_equal(x, y).item()


def _rows(n: int, seed: int) -> tuple[mx.array, mx.array]:
    key_k, key_v = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, 1, n, 32), key=key_k), mx.random.normal((1, 1, n, 32), key=key_v)


@pytest.mark.parametrize("name", sorted(CASES))
def test_trimming_a_verify_chunk_leaves_bitwise_the_store_of_the_accepted_rows(name, tmp_path):
    """The mechanism alone, on given keys and values: a store that took k + 1 rows at once
    and dropped the last k - n is, bit for bit, one that took the first n + 1 one by one,
    and attends alike."""
    case = CASES[name]
    window = 24 if case.model == "gemma3" else None

    def store(folder) -> tuple[list, PageReader | None]:
        cache = [kvexec.PagedKVCache(KVConfig(sink_tokens=case.sinks, **SMALL), window=window)]
        reader = None
        if case.disk:
            reader = PageReader()
            kvexec.spill_layers(cache, PageFile(folder), reader, 1)
        for start in range(0, case.prompt, 19):
            k, v = _rows(min(19, case.prompt - start), seed=start)
            cache[0].update_and_fetch(k, v)
            cache[0].attend(mx.zeros((1, 2, k.shape[-2], 32)), 0.2)  # where a layer on disk spills
        if case.exact:
            kvexec.keep_exact(cache, case.prompt)
        return cache, reader

    room = kvexec.chunk_room(store(tmp_path / "probe")[0], 12)
    assert room >= 8, room
    keys, values = _rows(room, seed=99)
    query = mx.random.normal((1, 2, 1, 32), key=mx.random.key(7))
    for accepted in range(room):
        verified, reader_v = store(tmp_path / f"v{accepted}")
        verified[0].update_and_fetch(keys, values)
        assert kvexec.trim(verified, room - 1 - accepted)
        one_by_one, reader_o = store(tmp_path / f"o{accepted}")
        for i in range(accepted + 1):
            one_by_one[0].update_and_fetch(keys[..., i:i + 1, :], values[..., i:i + 1, :])
        _assert_same_state(verified, one_by_one)
        for c in (verified, one_by_one):
            c[0].update_and_fetch(*_rows(1, seed=5))
        assert _same(verified[0].attend(query, 0.2), one_by_one[0].attend(query, 0.2))
        for r in (reader_v, reader_o):
            if r is not None:
                r.close()


def _float16_ulps(a: dict, b: dict) -> float:
    """The largest difference between same-named float16 arrays in units of float16's
    spacing at each array's largest magnitude (a value that fp32 reordering moved across
    a rounding boundary is one unit away, never more); every other array (page codes,
    positions) the same bit for bit."""
    worst = 0.0
    for k in a:
        if a[k].dtype != mx.float16:
            assert mx.array_equal(a[k], b[k]).item(), k
            continue
        x, y = a[k].astype(mx.float32), b[k].astype(mx.float32)
        top = float(mx.maximum(mx.abs(x), mx.abs(y)).max().item())
        worst = max(worst, float(mx.abs(x - y).max().item()) / float(np.spacing(np.float16(top))))
    return worst


@pytest.mark.parametrize("name", sorted(CASES))
def test_model_verify_then_trim_is_the_cache_of_the_accepted_tokens(name, tmp_path):
    """Through a model: the same layout and positions bit for bit; the verified tokens'
    keys and values from a pass of k + 1 rows differ from one-token passes' only by
    rounding (the hot window keeps float16: an ulp), and the next token is the same;
    the state saved after the rollback restores bit for bit."""
    case = CASES[name]
    model = _model(case.model)
    prompt = _tokens(case.prompt, seed=1)
    pending = 5
    room = kvexec.chunk_room(_prefilled(case, tmp_path / "probe", prompt)[0], 12)
    draft = _tokens(room - 1, seed=2)
    for accepted in sorted({0, 1, len(draft) // 2, len(draft)}):
        verified, reader_v = _prefilled(case, tmp_path / f"v{accepted}", prompt)
        verify_logits = _step(model, verified, [pending] + draft)
        assert kvexec.trim(verified, len(draft) - accepted)
        one_by_one, reader_o = _prefilled(case, tmp_path / f"o{accepted}", prompt)
        for t in [pending] + draft[:accepted]:
            _step(model, one_by_one, [t])
        (arrays_v, meta_v), (arrays_o, meta_o) = _held(verified), _held(one_by_one)
        assert meta_v == meta_o
        assert {k: (a.dtype, a.shape) for k, a in arrays_v.items()} == {k: (a.dtype, a.shape) for k, a in arrays_o.items()}
        assert _float16_ulps(arrays_v, arrays_o) <= 1
        follow = int(mx.argmax(verify_logits[accepted]).item())
        saved = rebuild(*capture(verified))  # as statetrans stores it and a later turn restores it
        after_v, after_o, after_s = (_step(model, c, [follow]) for c in (verified, one_by_one, saved))
        assert _same(after_s, after_v)
        assert float(mx.abs(after_v - after_o).max().item()) <= HOT_ULP * float(mx.abs(after_o).max().item())
        assert mx.argmax(after_v).item() == mx.argmax(after_o).item()
        for r in (reader_v, reader_o):
            if r is not None:
                r.close()


def test_a_snapshot_written_after_a_rollback_restores_the_same_logits(tmp_path):
    """Bit for bit against the same cache rolled back and not saved (the same passes on
    both sides); against one-token steps, within a float16 ulp of the hot window's keys
    and values (a pass of 7 rows computes them with other sums than one-row passes on
    some BLAS builds)."""
    case = Case("llama", 60, sinks=2, exact=True)
    model = _model(case.model)
    prompt, draft = _tokens(case.prompt, seed=3), _tokens(6, seed=4)

    def rolled_back(folder):
        cache, _ = _prefilled(case, folder, prompt)
        assert kvexec.chunk_room(cache, 1 + len(draft)) == 1 + len(draft)
        _step(model, cache, [7] + draft)
        assert kvexec.trim(cache, 4)
        return cache

    arrays, layers = capture(rolled_back(tmp_path / "saved"))
    save_snapshot(tmp_path / "snap", arrays, {"layers": layers})
    arrays, manifest = load_snapshot(tmp_path / "snap")
    restored = rebuild(arrays, manifest["layers"])
    after_restore = _step(model, restored, [11])
    assert _same(after_restore, _step(model, rolled_back(tmp_path / "kept"), [11]))
    one_by_one, _ = _prefilled(case, tmp_path / "single", prompt)
    for t in [7] + draft[:2]:
        _step(model, one_by_one, [t])
    after_steps = _step(model, one_by_one, [11])
    assert float(mx.abs(after_restore - after_steps).max().item()) <= HOT_ULP * float(mx.abs(after_steps).max().item())
    assert mx.argmax(after_restore).item() == mx.argmax(after_steps).item()


@pytest.mark.parametrize("name", ["hot window only", "sliding-window layers", "pages on disk"])
def test_verify_logits_against_one_at_a_time(name, tmp_path):
    """A verify pass's row i against the one-token step's logits at the same position:
    the same within fp32 reordering (REORDERING), which a row shifted by one position is
    not; the same greedy tokens. (Bit for bit where the products do not depend on the row
    count: the engine's native decode kernels, tests/engine/test_numerics.py.)"""
    case = CASES[name]
    model = _model(case.model)
    prompt = _tokens(case.prompt, seed=5)
    chunk = [5] + _tokens(kvexec.chunk_room(_prefilled(case, tmp_path / "p", prompt)[0], 8) - 1, seed=6)
    together, _ = _prefilled(case, tmp_path / "t", prompt)
    alone, _ = _prefilled(case, tmp_path / "a", prompt)
    rows = _step(model, together, chunk)
    single = mx.concatenate([_step(model, alone, [t]) for t in chunk])
    bound = REORDERING * float(mx.abs(single).max().item())
    worst = float(mx.abs(rows - single).max().item())
    assert worst <= bound, (worst, bound)
    assert float(mx.abs(rows[1:] - single[:-1]).max().item()) > 100 * bound  # the bound tells a shift
    assert mx.array_equal(mx.argmax(rows, axis=-1), mx.argmax(single, axis=-1)).item()

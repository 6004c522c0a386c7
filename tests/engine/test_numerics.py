"""One numerics per token (justfit.engine.numerics): a row's logits, keys and values are bitwise
the same whether the row is computed alone (a decode step), in a prefill chunk of any
size, as a row of a batched step or inside a verified draft; the kernels that promise
it (native/: quantized products, decode attention) and the engine's choice of mode,
including the one-row fallback where no such kernels run (the MLX-only path, Metal)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvexec
from justfit import Engine, SamplingParams
from justfit.engine import numerics
from justfit.engine.batch import decode_step, verify_step
from justfit.config import EngineConfig
from kvexec import KVConfig, PagedKVCache
from phaseswap import native
from phaseswap.native import kernels
from tests.helpers.tiny_models import write_mlx_folder

needs_kernel = pytest.mark.skipif(numerics.invariant_kernels() is not None,
                                  reason="row-invariant kernels: the native ones (not built here, or JUSTFIT_NATIVE=0)")
KV = KVConfig(format="q4c", page_size=32, hot_window=32)


# -- the kernels ------------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("activation_bits", [32, 16, 8])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_products_row_does_not_depend_on_the_rows_beside_it(activation_bits, bits):
    if activation_bits != 32 and not native.rounded_available():
        pytest.skip("rounded activations need AVX2")
    mx.random.seed(0)
    w = mx.random.normal((96, 128))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    x = mx.random.normal((1, 20, 128))
    full = np.array(kernels().quantized_matvecs(x, [q], [s], [b], 32, [bits], activation_bits=activation_bits)[0])
    for rows in (1, 2, 3, 4, 5, 8, 9, 17):
        part = np.array(kernels().quantized_matvecs(x[:, :rows], [q], [s], [b], 32, [bits],
                                                    activation_bits=activation_bits)[0])
        assert np.array_equal(part[0], full[0, :rows]), rows


def _filled(cfg: KVConfig, keys, values, sizes: list[int], window: int | None) -> PagedKVCache:
    cache, at = PagedKVCache(cfg, window), 0
    for n in sizes:
        cache.update_and_fetch(keys[:, :, at:at + n], values[:, :, at:at + n])
        at += n
    return cache


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8c", "q4c", "fp16"])
@pytest.mark.parametrize("start, rows, window", [(0, 20, None), (150, 3, None), (0, 30, 8), (40, 12, 16)])
def test_attention_rows_of_a_chunk_are_lone_queries_at_their_positions(fmt, start, rows, window):
    """A chunk's rows (pages, hot window, a sliding window) against one decode step at
    each position, the cache holding exactly what it held then."""
    cfg = KVConfig(format=fmt, page_size=32, hot_window=32)
    mx.random.seed(1)
    n = start + rows
    keys, values, q = (mx.random.normal((1, h, n, 64)) for h in (3, 3, 9))
    probe = _filled(cfg, keys, values, [start] if start else [], window)
    assert kvexec.chunk_room([probe], rows) == rows  # the chunk crosses no page flush
    chunk = _filled(cfg, keys, values, ([start] if start else []) + [rows], window)
    chunk.store.row_invariant = True
    together = np.array(chunk.attend(q[:, :, start:], 0.125, tokens_major=True))
    for i in range(rows):
        alone = _filled(cfg, keys, values, ([start] if start else []) + [1] * (i + 1), window)
        row = np.array(alone.attend(q[:, :, start + i:start + i + 1], 0.125, tokens_major=True))
        assert np.array_equal(row[0, 0], together[0, i]), i


# -- the engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def engine(request, tmp_path_factory):
    folder = write_mlx_folder(tmp_path_factory.mktemp("numerics") / request.param, request.param, head_dim=32,
                              quantize_bits=4)
    return Engine(str(folder), config=EngineConfig(kv=KV, deterministic=True,
                                                   state_dir=str(tmp_path_factory.mktemp("states"))))


TOKENS = [(11 * j) % 200 + 3 for j in range(120)]  # past sinks + hot window + a page: pages too


def _rows(engine: Engine, chunk: int) -> np.ndarray:
    """The logits of TOKENS fed in chunks of `chunk` on the decode forms, each cut short
    of a page flush as a deterministic prefill cuts it (kvexec.chunk_room)."""
    cache, out, at = engine.new_cache(), [], 0
    kvexec.row_invariant(cache)
    while at < len(TOKENS):
        n = min(len(TOKENS) - at, kvexec.chunk_room(cache, chunk))
        with engine.swap.phase("decode"):
            out.append(np.array(verify_step(engine.model, TOKENS[at:at + n], cache)))
        at += n
    return np.concatenate(out)


@needs_kernel
def test_the_engine_computes_every_row_as_a_decode_step(engine):
    assert engine.numerics.mode == "row-invariant" and engine.numerics.deterministic
    alone = _rows(engine, 1)
    for chunk in (7, 32, 64):
        assert np.array_equal(_rows(engine, chunk), alone), chunk


@needs_kernel
def test_a_batched_step_gives_each_sequence_its_lone_logits(engine):
    prompts = [TOKENS[:40], TOKENS[10:90], TOKENS[5:20]]
    caches = []
    for p in prompts:
        c = engine.new_cache()
        kvexec.row_invariant(c)
        with engine.swap.phase("decode"):
            verify_step(engine.model, p, c)
        caches.append(c)
    with engine.swap.phase("decode"):
        together = np.array(decode_step(engine.model, [7, 8, 9], caches))
    for i, p in enumerate(prompts):
        c = engine.new_cache()
        kvexec.row_invariant(c)
        with engine.swap.phase("decode"):
            verify_step(engine.model, p, c)
            alone = np.array(decode_step(engine.model, [7 + i], [c]))
        assert np.array_equal(alone[0], together[i])


def test_the_choice_of_numerics(engine, monkeypatch):
    """Fast unless asked; asked: row-invariant where the kernels are and agree on the
    model at load, else one row per forward."""
    args = (engine.model, engine.swap, engine.new_cache)
    assert numerics.choose(False, *args, paged=True).mode == "fast"
    assert numerics.choose(True, *args, paged=False).mode == "one-row"
    monkeypatch.setattr(numerics, "invariant_kernels", lambda: "no kernels here")
    assert numerics.choose(False, *args, paged=True).mode == "fast"
    one = numerics.choose(True, *args, paged=True)
    assert one.mode == "one-row" and one.deterministic and one.one_row and "no kernels here" in one.reason
    monkeypatch.setattr(numerics, "invariant_kernels", lambda: None)
    monkeypatch.setattr(numerics, "rows_agree", lambda *a: False)
    assert "other bits" in numerics.choose(True, *args, paged=True).reason


def test_one_row_numerics_prefill_a_token_at_a_time_and_never_draft(tmp_path, monkeypatch):
    """The fallback's plan: chunks of one, no verify rows, each sequence its own step;
    its replies are the same cold, repeated and batched."""
    monkeypatch.setattr(numerics, "invariant_kernels", lambda: "no kernels here")
    folder = write_mlx_folder(tmp_path / "llama", "llama", head_dim=32)
    e = Engine(str(folder), config=EngineConfig(kv=KV, deterministic=True, state_dir=str(tmp_path / "s")))
    assert e.numerics.one_row and e.planner.verify_rows == 1
    _, plan = e.planner.check_fits(60, 20)
    assert plan.shape.chunk == 1 and not plan.shape.dense_prefill
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cold = e.reply(TOKENS[:60], sp)
    assert cold.stats.drafted_tokens == 0
    assert e.reply(TOKENS[:60], sp).tokens == cold.tokens


@needs_kernel
def test_by_default_a_verified_draft_is_the_steps_it_stands_for(engine, tmp_path):
    """The default (fast) numerics prefill on the dense forms, but a decode step's rows
    (a draft verified with the pending token) are bitwise the single steps they replace."""
    fast = Engine(str(engine.path), config=EngineConfig(kv=KV, state_dir=str(tmp_path)))
    assert fast.numerics.mode == "fast"
    prompt, fed = TOKENS[:70], TOKENS[70:87]

    def after_prompt() -> list:
        cache = fast.new_cache()
        with fast.swap.phase("prefill"):
            verify_step(fast.model, prompt, cache)
        return cache

    cache = after_prompt()
    with fast.swap.phase("decode"):
        together = np.array(verify_step(fast.model, fed, cache))
    cache = after_prompt()
    with fast.swap.phase("decode"):
        steps = np.concatenate([np.array(decode_step(fast.model, [t], [cache])) for t in fed])
    assert np.array_equal(together, steps)

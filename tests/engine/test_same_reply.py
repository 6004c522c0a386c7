"""Same request, same reply: a prompt's greedy (and fixed-seed sampled) reply does not
depend on how the engine computed it: cold, with the exact prompt stored (a repeat),
with a shared prefix stored, with other prefill chunks, inside a batch of four, after
preemption to disk mid-reply, and after a restart (the disk tier).

The tiny model's pages are small (32 tokens, hot window 32) so a reply pages positions
of its prompt, which is what a repeat used to get back only in their lossy page form
(kvexec.exact keeps what a trim to the prompt needs). Paths not yet identical are
strict xfails that say what differs."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from justfit import Engine, SamplingParams
from justfit.engine.scheduler import Scheduler, plan_sequence
from justfit.config import EngineConfig
from kvexec import KVConfig
from kvexec.export import copy_layer, export_store, restore_store
from kvexec.store import PageStore

KV = KVConfig(format="q4c", page_size=32, hot_window=32)  # a 4-bit format: paging is visibly lossy
PROMPT = [(13 * j) % 200 + 3 for j in range(50)]  # stays in the hot window until the reply pages it
LONG = [(7 * j) % 230 + 3 for j in range(150)]  # pages during its own prefill
NEW = 60


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _seeded(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model_dir(request, tmp_path_factory):
    """Tiny random models: llama, and Gemma 3 with sliding-window layers; their window
    (256) holds every reply here, so a stored state can be trimmed back to a prompt (a
    window that dropped positions cannot be: tests/engine/test_numerics.py runs window 16)."""
    from tests.helpers.tiny_models import write_mlx_folder

    return write_mlx_folder(tmp_path_factory.mktemp("same") / request.param, request.param, head_dim=32,
                            quantize_bits=4, sliding_window=256)


def _engine(path, state_dir, chunk: int = 512, **config) -> Engine:
    return Engine(str(path), config=EngineConfig(kv=KV, prefill_chunk=chunk, state_dir=str(state_dir),
                                                 deterministic=True, **config))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    return _engine(model_dir, tmp_path_factory.mktemp("states"))


def _reply(engine: Engine, tokens: list[int], sp: SamplingParams) -> list[int]:
    return [c.token for c in engine.generate(tokens, sp) if c.token is not None]


def _cold(engine: Engine, tokens: list[int], sp: SamplingParams) -> list[int]:
    engine.reset()
    reply = engine.reply(tokens, sp)
    assert reply.stats.cached_tokens == 0
    return reply.tokens


# -- the store: a trim back to the exact point is the store that stopped there ------------

def _store_arrays(store: PageStore) -> dict[str, np.ndarray]:
    arrays, meta = export_store(store)
    out = {k: np.array(v) for k, v in arrays.items() if not k.startswith("exact_")}
    return out | {"layout": [(s["start"], s["length"], s["format"]) for s in meta["segments"]] + [meta["offset"]]}


def _written(upto: int, at: int | None, chunks: tuple[int, ...]) -> PageStore:
    mx.random.seed(3)
    keys, values = mx.random.normal((1, 2, 200, 32)), mx.random.normal((1, 2, 200, 32))
    store, done = PageStore(KV), 0
    if at is not None:
        store.keep_exact(at)
    for size in chunks + (1,) * (upto - sum(chunks)):
        store.append(keys[..., done:done + size, :], values[..., done:done + size, :])
        done += size
    return store


@pytest.mark.parametrize("at, chunks", [(49, (49,)), (49, (20, 29)), (120, (100, 20)), (101, (101,))])
@pytest.mark.parametrize("copy", ["none", "export", "copy_layer"])
def test_a_trim_back_to_the_exact_point_is_the_store_that_stopped_there(at, chunks, copy):
    stopped = _written(at, None, chunks)
    grown = _written(190, at, chunks)
    assert grown.pages > stopped.pages  # the reply paged positions the point needs
    if copy == "export":
        grown = restore_store(*export_store(grown))
    elif copy == "copy_layer":
        grown = copy_layer(_as_layer(grown)).store
    assert grown.exact.nbytes <= 2 * (KV.hot_window + KV.page_size) * 2 * 32 * 2  # at most a hot window, keys and values
    assert grown.trim(190 - at) == 190 - at
    got, want = _store_arrays(grown), _store_arrays(stopped)
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) if k != "layout" else got[k] == want[k] for k in want)


def _as_layer(store: PageStore):
    from kvexec.export import paged_cache_from_store

    return paged_cache_from_store(store)


def test_a_trim_the_point_does_not_cover_still_trims_lossily():
    grown = _written(190, 49, (49,))
    assert grown.trim(190 - 20) == 170 and grown.offset == 20  # below the point: pages decoded, as before


def test_an_exact_point_survives_a_snapshot_check():
    from kvexec.export import check_layer

    arrays, meta = export_store(_written(190, 49, (49,)))
    shapes = {k: (str(v.dtype).rpartition(".")[2], tuple(v.shape)) for k, v in arrays.items()}
    check_layer({"kind": "paged", **meta}, shapes)
    with pytest.raises(ValueError):
        check_layer({"kind": "paged", **meta, "exact": {"at": 49, "start": 40}}, shapes)  # copies past the point
    with pytest.raises(ValueError):
        check_layer({"kind": "paged", **meta}, {k: v for k, v in shapes.items() if k != "exact_v"})


# -- the engine: every path against the cold reply ------------------------------------------

@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
def test_a_repeat_and_a_shared_prefix_give_the_cold_reply(engine, sp):
    cold = _cold(engine, PROMPT, sp)
    again = engine.reply(PROMPT, sp)
    assert again.tokens == cold and again.stats.cached_tokens == len(PROMPT) - 1
    assert _reply(engine, PROMPT, sp) == cold  # and again, from the repeat's own state
    engine.reset()
    _reply(engine, PROMPT[:30] + [5, 6, 7, 8], sp)
    shared = engine.reply(PROMPT, sp)
    assert shared.tokens == cold and shared.stats.cached_tokens == 30


def test_a_repeat_of_a_prompt_paged_in_its_prefill_gives_the_cold_reply(engine):
    cold = _cold(engine, LONG, _greedy())
    again = engine.reply(LONG, _greedy())
    assert again.tokens == cold and again.stats.cached_tokens == len(LONG) - 1


def test_drafts_verified_in_one_forward_give_the_plain_reply(model_dir, tmp_path):
    """A step that feeds the pending token and its draft (some drafted tokens wrong, so
    verifies accept all, part and none) computes each row as a lone step would: the
    reply with drafting is the one without."""
    from justfit.engine.stats import collect
    from bench.loop import run_all
    from tests.engine.test_speculative_decoding import Oracle

    for prompt in (PROMPT, LONG):  # a new engine each: no step costs measured yet that decline drafts
        engine = _engine(model_dir, tmp_path / str(len(prompt)))
        plain = _cold(engine, prompt, replace(_greedy(), speculate=False))
        engine.reset()
        seq = plan_sequence(engine, prompt, _greedy(), drafter=lambda p: Oracle(p, plain))
        assert collect(c for _, c in run_all(Scheduler(engine, serve=False), [seq]) if c is not None).tokens == plain
        if engine.numerics.one_row:  # one row per forward (no row-invariant kernels here): no drafts
            assert seq.stats.drafted_tokens == 0
        else:
            assert seq.stats.drafted_tokens > seq.stats.accepted_tokens > 0


@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
def test_a_next_turn_resumed_from_the_last_gives_its_cold_reply(engine, sp):
    """Turn 2 resumes from turn 1's state, whose reply was decoded a token at a time;
    cold, the same tokens are prefilled in chunks: the same reply either way."""
    first = _cold(engine, PROMPT, sp)
    turn = PROMPT + first + [(17 * j) % 150 + 3 for j in range(40)]
    cold = _cold(engine, turn, sp)
    engine.reset()
    _reply(engine, PROMPT, sp)
    resumed = engine.reply(turn, sp)
    assert resumed.stats.cached_tokens >= len(PROMPT) and resumed.tokens == cold


def test_without_the_exact_point_a_repeat_differs(engine, monkeypatch):
    """The matrix above tests something: the lossy trim it replaces changes this reply."""
    import kvexec

    cold = _cold(engine, PROMPT, _greedy())
    monkeypatch.setattr(kvexec, "keep_exact", lambda cache, position: None)
    engine.reset()
    assert _reply(engine, PROMPT, _greedy()) == cold
    assert _reply(engine, PROMPT, _greedy()) != cold


@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [16, 64, 2048])
def test_other_prefill_chunks_give_the_cold_reply(model_dir, engine, tmp_path, chunk, sp):
    cold = _cold(engine, PROMPT, sp)
    assert _reply(_engine(model_dir, tmp_path, chunk), PROMPT, sp) == cold


@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_other_prefill_chunks_of_a_prompt_paged_in_its_prefill(model_dir, engine, tmp_path, chunk, sp):
    """Chunks stop short of a page flush (kvexec.chunk_room): each position attends to
    the pages it would alone, whatever the chunk size."""
    cold = _cold(engine, LONG, sp)
    assert _reply(_engine(model_dir, tmp_path, chunk), LONG, sp) == cold
    engine.reset()
    assert _batched(engine, [LONG, PROMPT], sp)[0] == cold


def _batched(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    runner = Scheduler(engine, max_batch=len(prompts), serve=False)
    seqs = [plan_sequence(engine, p, sp) for p in prompts]
    for s in seqs:
        runner.admit(s)
    got: dict[int, list[int]] = {id(s): [] for s in seqs}
    for _ in range(10 * NEW * len(prompts)):
        if not runner.live:
            break
        for seq, chunk in runner.step():
            if chunk is not None and chunk.token is not None:
                got[id(seq)].append(chunk.token)
    return [got[id(s)] for s in seqs]


@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
def test_in_a_batch_of_four_each_gets_its_cold_reply(engine, sp):
    prompts = [PROMPT, PROMPT[:20] + [9] * 30, [(3 * j) % 100 + 3 for j in range(70)], [5] * 10]
    alone = [_cold(engine, p, sp) for p in prompts]
    engine.reset()
    assert _batched(engine, prompts, sp) == alone
    assert _reply(engine, PROMPT, sp) == alone[0]  # and the batch's stored state repeats it


@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
def test_preempted_to_disk_mid_reply_gives_the_cold_reply(engine, sp):
    cold = _cold(engine, PROMPT, sp)
    engine.reset()
    runner = Scheduler(engine, max_batch=4, serve=False)
    seq = plan_sequence(engine, PROMPT, sp)
    runner.admit(seq)
    got = []
    parked = False
    for _ in range(10 * NEW):
        if not runner.live:
            break
        if not parked and len(got) == NEW // 2:  # past the point the reply starts paging the prompt
            seq.park()
            seq.resume()
            parked = True
        got += [c.token for s, c in runner.step() if c is not None and c.token is not None]
    assert parked and got == cold
    assert _reply(engine, PROMPT, sp) == cold  # its stored state repeats it too


@pytest.mark.parametrize("sp", [_greedy(), _seeded()], ids=["greedy", "seeded"])
def test_after_a_restart_the_stored_state_gives_the_cold_reply(model_dir, tmp_path, sp):
    first = _engine(model_dir, tmp_path)
    cold = _reply(first, PROMPT, sp)
    first.states.fit(0)  # every stored state to disk
    del first
    later = _engine(model_dir, tmp_path)
    again = later.reply(PROMPT, sp)
    assert again.tokens == cold
    assert again.stats.cached_tokens == len(PROMPT) - 1 and again.stats.restored_from == "disk"


# -- SmolLM2 end to end ------------------------------------------------------------------------

needs_invariant_kernels = pytest.mark.skipif(
    "__import__('justfit.engine.numerics').engine.numerics.invariant_kernels() is not None",
    reason="SmolLM2 one row per forward (no row-invariant kernels here) takes minutes; the tiny models cover it")


def _every_path(prompts: int, reply: int, prompt: int) -> dict:
    """bench.same_reply's matrix for its first `prompts` prompts (code, prose, a chat
    turn), each cut to its last `prompt` tokens, `reply` tokens each."""
    from bench.same_reply import PATHS, run

    result = run("smollm2", prompts, reply, prompt, True, PATHS, log=lambda line: None)
    assert result["numerics"]["mode"] == "row-invariant"
    return result


@needs_invariant_kernels
def test_smollm2_gives_the_cold_reply_on_every_path():
    """Code to copy: repeated, from a shared prefix, in chunks of 64 and 2,048, in a batch
    of four, without drafts, preempted to disk, after a restart, and as the next turn."""
    result = _every_path(1, 24, 300)
    assert all(s["identical"] == s["compared"] == 1 for s in result["summary"].values()), result["prompts"]


@pytest.mark.skipif("not config.getoption('--long')", reason="long variant: --long")
@needs_invariant_kernels
def test_smollm2_more_prompts_long():
    result = _every_path(6, 64, 700)
    assert all(s["identical"] == s["compared"] == 6 for s in result["summary"].values()), result["prompts"]

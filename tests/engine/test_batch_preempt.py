"""Preemption to disk (justfit.engine.scheduler with `preempt`): under a budget that holds two
sequences at full length, four all complete token-identical to each alone, the newest
set aside on disk and resumed with its state byte-exact; one cancelled while set aside
keeps what it computed as a stored state; a parked snapshot is checked when read back
and survives its process (statetrans.parking)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from justfit import Engine, SamplingParams
from justfit.engine.scheduler import Scheduler, plan_sequence
from justfit.config import EngineConfig
from statetrans import SnapshotError, StateTiers, capture, park, unpark

PROMPT, NEW = 96, 48
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(PROMPT)] for i in range(4)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _two_long(path, state_dir) -> Engine:
    """An engine whose budget holds two sequences at PROMPT + NEW positions, not three."""
    engine = Engine(str(path), config=EngineConfig(budget_bytes=1 << 30, prefill_chunk=32, state_dir=str(state_dir)))
    engine.reply(PROMPTS[0], _greedy(NEW))  # the planner's reserve measured, as the requests below plan with it
    engine.reset()
    one = engine.planner.footprint(PROMPT + NEW)
    engine.set_budget(one.weights + one.working + one.transient + 2 * one.kv + one.reserve)
    return engine


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    return _two_long(tiny_llama_dir, tmp_path_factory.mktemp("states"))


def _alone(engine: Engine, tokens: list[int]) -> list[int]:
    engine.reset()
    out = [c.token for c in engine.generate(tokens, _greedy(NEW)) if c.token is not None]
    engine.reset()
    return out


def _arrays(cache: list) -> dict[str, np.ndarray]:
    arrays, layers = capture(cache)
    return {k: np.array(v.view(mx.uint8) if v.dtype != mx.uint8 else v) for k, v in arrays.items()} | {"meta": layers}


def test_four_long_sequences_under_a_budget_for_two_complete_as_alone(engine):
    alone = [_alone(engine, p) for p in PROMPTS]
    runner = Scheduler(engine, serve=False, max_batch=4)
    seqs = [plan_sequence(engine, p, _greedy(NEW)) for p in PROMPTS]
    admitted = 0
    for s in seqs:
        if runner.fits(s):
            runner.admit(s)
            admitted += 1
    assert admitted >= 3  # counted at what they hold now, more join than their full lengths allow
    got: dict[int, list[int]] = {}
    pending = [s for s in seqs if s not in runner.live]
    for _ in range(2000):
        while pending and runner.fits(pending[0]):
            runner.admit(pending.pop(0))
        if not runner.live and not runner.parked and not pending:
            break
        runner._resume()
        runner._make_room()  # what step() does first: the step to come fits
        assert len(runner.live) == 1 or runner._need(runner.live) <= engine.budget.bytes
        for seq, chunk in runner.step():
            if chunk is not None and chunk.token is not None:
                got.setdefault(id(seq), []).append(chunk.token)
    assert [got[id(s)] for s in seqs] == alone
    assert runner.preemptions > 0 and runner.swap_s > 0
    assert sum(s.stats.preemptions for s in seqs) == runner.preemptions
    assert all(s.stats.preempted_s >= s.stats.swap_s for s in seqs)
    # Every parked snapshot was read back and deleted: what anon/ holds is indexed.
    on_disk = {p.name for p in (engine.states.dir / "anon").glob("[!.]*")}
    assert on_disk <= {e.path.name for e in engine.states.entries.values() if e.path is not None}
    engine.reset()


def test_a_parked_sequence_comes_back_byte_exact(engine):
    seq = plan_sequence(engine, PROMPTS[0], _greedy(NEW))
    runner = Scheduler(engine, max_batch=4, serve=False)
    runner.admit(seq)
    while seq.remaining or len(seq.held) < PROMPT + 5:
        runner.step()
    before, held, pending = _arrays(seq.cache), list(seq.held), seq.pending
    seq.park()
    assert seq.cache is None and seq.parked.path.exists()
    seq.resume()
    after = _arrays(seq.cache)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) if k != "meta" else before[k] == after[k] for k in before)
    assert seq.held == held and seq.pending == pending
    runner.leave(seq)
    engine.reset()


def test_a_sequence_cancelled_while_parked_keeps_its_state(engine):
    engine.reset()
    seq = plan_sequence(engine, PROMPTS[1], _greedy(NEW))
    runner = Scheduler(engine, max_batch=4, serve=False)
    runner.admit(seq)
    runner.step()
    runner.step()
    held = list(seq.held)
    seq.park()
    runner.live.remove(seq)
    runner.parked.append(seq)
    runner.leave(seq)  # its client went away while it was set aside
    assert not runner.parked
    reuse = engine.states.take(held + [1], None)
    assert reuse.tokens == held and reuse.source == "disk"
    engine.reset()


def test_a_parked_snapshot_is_checked_and_outlives_its_process(engine, tmp_path):
    engine.reset()
    list(engine.generate(PROMPTS[2][:40], _greedy(1)))
    stored = engine.states.last
    tokens, cache = list(stored.tokens), stored.cache
    parked = park(engine.states, tokens, cache)
    # A process killed while the sequence waited: the next one finds the snapshot as a stored state.
    later = StateTiers(engine.states.dir.parent, engine.states.identity, engine.states.layers, 1 << 30, 1 << 30)
    assert any(e.tokens == tokens for e in later.entries.values())
    with pytest.raises(SnapshotError):  # tokens that are not the parked ones
        unpark(engine.states, type(parked)(**{**vars(parked), "tokens": tokens[:-1]}))
    restored, seconds = unpark(engine.states, parked)
    assert seconds >= 0 and not parked.path.exists()
    assert all(np.array_equal(a, b) for a, b in zip(_arrays(cache).values(), _arrays(restored).values()))
    engine.reset()

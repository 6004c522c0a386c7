"""Several requests at once (justfit.engine.scheduler): batched greedy decoding equals each
request alone; sequences join and leave mid-batch; a cancelled one leaves within a
step with its state stored; a short prompt is served between a long one's chunks; the
batch is admitted on the sum of its plans. Preemption: tests/engine/test_batch_preempt.py."""

from __future__ import annotations

import pytest

from justfit import Engine, SamplingParams
from justfit.engine.scheduler import Scheduler, plan_sequence
from justfit.config import EngineConfig

PROMPTS = ([5, 9, 13, 2, 77, 31, 8], list(range(40, 140)), [200, 3, 3, 3, 9, 120, 64, 1, 2, 33, 90, 11, 4])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _alone(engine: Engine, tokens: list[int], n: int) -> list[int]:
    engine.reset()
    out = [c.token for c in engine.generate(tokens, _greedy(n)) if c.token is not None]
    engine.reset()
    return out


def _drain(runner: Scheduler, got: dict, until=lambda: False, limit: int = 500) -> None:
    for _ in range(limit):
        if not runner.live or until():
            return
        for seq, chunk in runner.step():
            if chunk is not None and chunk.token is not None:
                got.setdefault(id(seq), []).append(chunk.token)
    raise AssertionError("the batch did not finish")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tiny_llama_dir, tiny_gemma3_dir):
    path = tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
    return Engine(str(path), config=EngineConfig(prefill_chunk=32))


def test_batched_greedy_equals_each_alone(engine):
    alone = [_alone(engine, p, 12) for p in PROMPTS]
    runner, got = Scheduler(engine, serve=False, max_batch=4), {}
    seqs = [plan_sequence(engine, p, _greedy(12)) for p in PROMPTS]
    for s in seqs:
        assert runner.fits(s)
        runner.admit(s)
    _drain(runner, got)
    assert [got[id(s)] for s in seqs] == alone
    assert runner.steps < sum(len(a) for a in alone)  # rows shared steps
    engine.reset()


def test_sequences_join_and_leave_mid_batch(engine):
    alone = [_alone(engine, PROMPTS[0], 20), _alone(engine, PROMPTS[1], 5), _alone(engine, PROMPTS[2], 9)]
    runner, got = Scheduler(engine, serve=False, max_batch=4), {}
    first = plan_sequence(engine, PROMPTS[0], _greedy(20))
    runner.admit(first)
    _drain(runner, got, until=lambda: len(got.get(id(first), [])) >= 4)
    later = [plan_sequence(engine, PROMPTS[1], _greedy(5)), plan_sequence(engine, PROMPTS[2], _greedy(9))]
    for s in later:  # join while `first` decodes
        runner.admit(s)
    _drain(runner, got)
    assert [got[id(first)], got[id(later[0])], got[id(later[1])]] == alone
    engine.reset()


def test_a_cancelled_sequence_leaves_with_its_state_stored(engine):
    alone = _alone(engine, PROMPTS[1], 10)
    runner, got = Scheduler(engine, serve=False, max_batch=4), {}
    keep, drop = plan_sequence(engine, PROMPTS[1], _greedy(10)), plan_sequence(engine, PROMPTS[2], _greedy(30))
    runner.admit(keep)
    runner.admit(drop)
    _drain(runner, got, until=lambda: len(got.get(id(drop), [])) >= 3)
    held = list(drop.held)
    runner.leave(drop)  # the client went away: out within this step
    assert drop not in runner.live and drop.cache is None
    _drain(runner, got)
    assert got[id(keep)] == alone
    # What it computed is stored: the same tokens again are served from that state.
    reuse = engine.states.take(held + [1], None, None)
    assert list(reuse.tokens) == held
    engine.reset()


def test_a_short_prompt_is_served_between_a_long_prompts_chunks(engine):
    runner, got = Scheduler(engine, serve=False, max_batch=4), {}
    long = plan_sequence(engine, list(range(1, 200)) * 2, _greedy(4))  # 398 tokens: 13 chunks of 32
    runner.admit(long)
    runner.step()  # its first chunk
    short = plan_sequence(engine, PROMPTS[0], _greedy(4))
    runner.admit(short)
    steps = 0
    while id(short) not in got:
        for seq, chunk in runner.step():
            if chunk is not None and chunk.token is not None:
                got.setdefault(id(seq), []).append(chunk.token)
        steps += 1
    assert steps == 1 and long.remaining > 0  # its first token came before the long prefill ended
    _drain(runner, got)
    assert got[id(short)] == _alone(engine, PROMPTS[0], 4)
    engine.reset()


def test_the_batch_is_admitted_on_the_sum_of_its_plans(tiny_llama_dir):
    probe = Engine(str(tiny_llama_dir))
    one = probe.planner.footprint(len(PROMPTS[1]) + 40, verify_rows=1)  # a plan gives up drafts before anything else
    # Room for one sequence's KV beside the weights, not for two.
    budget = one.total + one.kv // 2
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(budget_bytes=budget))
    runner = Scheduler(engine, serve=False, max_batch=4, preempt=False)  # each counted at its plan's end
    a, b = plan_sequence(engine, PROMPTS[1], _greedy(40)), plan_sequence(engine, PROMPTS[1][::-1], _greedy(40))
    assert runner.fits(a)
    runner.admit(a)
    assert not runner.fits(b)
    runner.leave(a)
    assert runner.fits(b)
    with pytest.raises(ValueError):
        Scheduler(engine, serve=False, max_batch=0)



def test_a_sequence_says_where_it_is(engine):
    """A sequence's status: planned, prefilling, decoding, set aside on disk, finished."""
    from justfit.engine.sequence import Status

    engine.reset()
    sched = Scheduler(engine, max_batch=4, serve=False)
    seq = plan_sequence(engine, PROMPTS[1], _greedy(3))  # 100 tokens: chunks of 32
    assert seq.status is Status.WAITING and seq.cache is None and seq.remaining == 0
    sched.admit(seq)
    assert seq.status is Status.PREFILLING and seq.remaining == len(PROMPTS[1])
    while seq.remaining:
        sched.step()
    assert seq.status is Status.DECODING and seq.pending is not None
    seq.park()
    assert seq.status is Status.PARKED and seq.remaining == 0
    seq.resume()
    assert seq.status is Status.DECODING
    while sched.live:
        sched.step()
    assert seq.status is Status.FINISHED and seq.finished and seq.cache is None
    engine.reset()


def test_a_drained_batch_measures_the_outside_share_again(tiny_llama_dir):
    """Under a whole-process budget the lone path re-measures what the process holds
    besides MLX after each request; the batch does so each time it drains."""
    import asyncio

    from justfit.engine.events import End
    from justfit.engine.job import Job
    from justfit.engine.scheduler import Scheduler

    engine = Engine(str(tiny_llama_dir), config=EngineConfig(budget_bytes=2**30, budget_covers_process=True))
    calls = []
    measure = engine.budget.remeasure
    engine.budget.remeasure = lambda *a, **k: (calls.append(k), measure(*a, **k))

    async def both():
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, max_batch=2)
        jobs = [Job(list(p), _greedy(4), loop) for p in PROMPTS[:2]]
        for job in jobs:
            sched.submit(job)
        for job in jobs:
            async for event in job.stream():
                if isinstance(event, End):
                    break
        sched.close()

    asyncio.run(both())
    assert calls and engine.budget.bytes < 2**30  # the engine's share is what the outside leaves
    assert any(k.get("seen", 0) > 0 for k in calls)  # with what the batch held besides MLX while it ran

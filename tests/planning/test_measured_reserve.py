"""The planner's reserve is measured, not padded: before any request (or without a
budget) the prior, 2% of the terms + 256 KiB; under a budget, after requests, the share
by which MLX's peak exceeded the footprint predicted at each request's own length and
chunk, a decaying maximum. Plans, the page allowance and max_positions use it."""

import mlx.core as mx
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.planning.budget import Budget, OutsideDecay, reserve_sample
from justfit.planning.cost_model import PAGE_MARGIN, PRIOR_RESERVE, RESERVE, RESERVE_FLOOR, Reserve
from tests.helpers.tiny_models import write_mlx_folder

MiB = 2**20
BUDGET = 256 * MiB


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("reserve") / "llama", "llama", seed=3, layers=2)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_the_prior_is_the_old_padding_and_a_reserve_is_never_negative():
    assert PRIOR_RESERVE.bytes(100 * MiB) == int(RESERVE * 100 * MiB) + RESERVE_FLOOR
    assert not PRIOR_RESERVE.measured and "prior" in PRIOR_RESERVE.describe()
    with pytest.raises(ValueError, match="below zero"):
        Reserve(-0.01, 0, True)
    assert "measured" in Reserve(0.015, 0, True, 3).describe()


def test_a_budget_measures_the_excess_as_a_decaying_maximum(tiny_dir):
    fp = Engine(str(tiny_dir), config=EngineConfig(policy="cpu")).planner.footprint(64)
    terms = fp.terms
    assert fp.total == terms + fp.reserve and fp.reserve == PRIOR_RESERVE.bytes(terms)
    assert reserve_sample(fp, terms // 2) == 0  # the peak within the prediction: nothing kept back
    assert reserve_sample(fp, terms + terms // 10) == pytest.approx(0.1, rel=1e-4)
    assert reserve_sample(fp, terms + terms // 10, states=terms // 10) == 0  # stored states are not the request's

    unbudgeted = Budget(None)
    unbudgeted.remeasure_reserve(fp, 2 * terms)
    assert unbudgeted.reserve is PRIOR_RESERVE  # no budget: the prior, nothing measured

    budget = Budget(BUDGET, decay=OutsideDecay(half_life=1))
    assert budget.reserve is PRIOR_RESERVE  # before any request
    budget.remeasure_reserve(fp, terms // 2)
    assert budget.reserve == Reserve(0.0, 0, True, 1)  # the first measurement replaces the prior
    budget.remeasure_reserve(fp, terms + terms // 5)
    assert budget.reserve.share == pytest.approx(0.2, rel=1e-4)  # a rise is taken at once
    budget.remeasure_reserve(fp, terms)
    assert budget.reserve.share == pytest.approx(0.1, rel=1e-4)  # a quiet request halves it (half-life 1): not gone
    budget.remeasure_reserve(fp, 0)  # a request that computed nothing measures nothing
    assert budget.reserve.requests == 3
    with budget.trial(None):
        assert budget.reserve is PRIOR_RESERVE  # planned without a budget: the prior
    assert budget.reserve.measured


def test_after_requests_the_reserve_is_the_measured_excess_and_plans_use_it(tiny_dir):
    engine = Engine(str(tiny_dir), budget=BUDGET, config=EngineConfig(policy="cpu"))
    prompt, sp = list(range(3, 203)), _greedy(4)
    before = engine.planner.footprint(len(prompt) + sp.max_tokens)
    assert before.shape.reserve is PRIOR_RESERVE and before.reserve == PRIOR_RESERVE.bytes(before.terms)
    seen = []
    measure = engine.budget.remeasure_reserve
    engine.budget.remeasure_reserve = lambda *a: (seen.append(a), measure(*a))
    reply = engine.reply(prompt, sp)
    (predicted, peak, states, besides), = seen  # the plan at the length the request reached
    assert predicted.shape.chunk == reply.stats.prefill_chunk and peak == reply.stats.memory.mlx_peak
    assert predicted.positions in (len(prompt) + sp.max_tokens - 1, len(prompt) + sp.max_tokens)
    reserve = engine.budget.reserve
    assert reserve.measured and reserve.requests == 1 and reserve.floor == 0
    assert reserve.share == reserve_sample(predicted, peak, states, besides)  # the measured excess, not 2%
    after = engine.planner.footprint(len(prompt) + sp.max_tokens)
    assert after.reserve == int(reserve.share * after.terms) and after.terms == before.terms
    assert after.reserve != before.reserve and after.as_dict()["reserve_measured"]
    assert "measured" in after.as_dict()["reserve_from"]


def test_a_peak_over_the_prediction_raises_the_reserve_and_narrows_plans(tiny_dir):
    engine = Engine(str(tiny_dir), budget=BUDGET, config=EngineConfig(policy="cpu"))
    prompt, sp = list(range(3, 203)), _greedy(2)
    engine.reply(prompt, sp)
    quiet = engine.budget.reserve.share
    fp = engine.planner.footprint(len(prompt) + sp.max_tokens)
    allowance, most = fp.page_allowance(BUDGET), engine.planner.edge_footprint().max_positions(BUDGET)
    assert allowance == fp.pages + int((BUDGET * (1 - PAGE_MARGIN) - fp.total) / (1 + quiet))

    extra = 16 * MiB
    held = []

    def progress(done, total):  # 16 MiB more in MLX through the prefill: a transient the terms leave out
        if not held:
            held.append(mx.ones((extra // 4,), dtype=mx.float32))
            mx.eval(held[0])
        elif done == total:
            held.clear()

    engine.reset()
    list(engine.generate(prompt, sp, progress=progress))
    raised = engine.budget.reserve
    assert raised.requests == 2 and raised.share > quiet
    wider = engine.planner.footprint(len(prompt) + sp.max_tokens)
    assert wider.reserve >= extra * 0.9  # measured at this request's own length and chunk: it transfers back whole
    assert wider.page_allowance(BUDGET) < allowance  # what the pages may take shrinks by it
    assert engine.planner.edge_footprint().max_positions(BUDGET) < most
    assert wider.page_allowance(BUDGET) == wider.pages + int((BUDGET * (1 - PAGE_MARGIN) - wider.total)
                                                             / (1 + raised.share))

    engine.reset()
    engine.reply(prompt, sp)  # a quiet request after it: the excess decays, one request does not wipe it
    assert quiet < engine.budget.reserve.share < raised.share


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_request_served_by_the_schedulers_worker_measures_the_reserve(tiny_dir, max_batch):
    """The server's worker thread runs the step loop Engine.generate runs: a request
    served there is measured as it leaves (justfit.planning.plan.measure_request), at
    max_batch 1 or more, as a lone one is."""
    import asyncio

    from justfit.engine.events import End, Failure, Token
    from justfit.engine.job import Job
    from justfit.engine.scheduler import Scheduler

    engine = Engine(str(tiny_dir), budget=BUDGET, config=EngineConfig(policy="cpu"))
    assert engine.budget.reserve is PRIOR_RESERVE
    seen = []
    measure = engine.budget.remeasure_reserve
    engine.budget.remeasure_reserve = lambda *a: (seen.append(a), measure(*a))

    async def serve() -> list:
        sched = Scheduler(engine, max_batch=max_batch)
        job = Job(list(range(3, 203)), _greedy(4), asyncio.get_running_loop())
        sched.submit(job)
        events = [event async for event in job.stream()]
        sched.close()
        return events

    events = asyncio.run(serve())
    assert isinstance(events[-1], End) and any(isinstance(e, Token) for e in events)
    assert not any(isinstance(e, Failure) for e in events)
    (predicted, peak, states, besides), = seen
    assert predicted.positions in (203, 204) and peak > 0
    reserve = engine.budget.reserve
    assert reserve.measured and reserve.requests == 1
    assert reserve.share == reserve_sample(predicted, peak, states, besides)

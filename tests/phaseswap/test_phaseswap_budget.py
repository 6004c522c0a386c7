"""PhaseSwap under a budget: what the plan takes before streaming layers (the resident
forms at the smallest chunk), what it refuses, and streaming below the weights."""


import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.errors import BudgetExceeded
from justfit.planning.cost_model import MIN_PREFILL_CHUNK


def test_resident_weights_refuse_what_would_need_streaming(q8_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path))
    free = Engine(str(q8_dir), config=EngineConfig(policy="cpu"))
    weights = free.swap.registry.total_bytes()
    prompt = "x " * 200
    positions = len(free.encode(prompt)) + 50
    # just short, every weight resident, prefilled the cheapest way (the smallest chunk, no drafts)
    budget = min(free.planner.footprint(positions, chunk=MIN_PREFILL_CHUNK, dense_prefill=dense, verify_rows=1).total
                 for dense in (False, True)) - 1024
    del free
    resident = EngineConfig(policy="cpu", offload_weights=False)
    with pytest.raises(BudgetExceeded):  # not even the weights: refused at load, nothing converted
        Engine(str(q8_dir), budget=weights // 2, config=resident)
    streaming = Engine(str(q8_dir), budget=budget, config=EngineConfig(policy="cpu"))
    offloaded, fp = streaming.planner.plan(positions)
    assert offloaded and fp.total <= budget  # streaming would run it
    eng = Engine(str(q8_dir), budget=budget, config=resident)
    offloaded, fp = eng.planner.plan(positions)
    assert offloaded == () and fp.total > budget  # the plan keeps every weight in memory
    with pytest.raises(BudgetExceeded) as err:
        list(eng.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    assert 0 < err.value.fits_positions < positions and eng.swap.offloaded == ()
    assert list(eng.generate("hi", SamplingParams(temperature=0, max_tokens=1)))  # what fits still runs


def test_a_tight_budget_prefills_at_the_smallest_chunk_before_streaming(q8_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path))
    prompt, sp = "x " * 200, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = Engine(str(q8_dir), config=EngineConfig(policy="cpu"))
    reply = free.reply(prompt, sp)
    want = reply.tokens
    assert any(p.materialized_bytes for p in reply.stats.phases)  # dense working copies, unconstrained
    positions = len(free.encode(prompt)) + 20
    wide = free.planner.footprint(positions)
    dense = free.planner.footprint(positions, chunk=MIN_PREFILL_CHUNK)
    resident = free.planner.footprint(positions, chunk=MIN_PREFILL_CHUNK, dense_prefill=False)
    # a dense lease holds one linear's copy at a time; the resident products dequantize two
    assert dense.working < resident.working and dense.total < wide.total
    del free
    eng = Engine(str(q8_dir), budget=dense.total + 4096, config=EngineConfig(policy="cpu"))
    offloaded, fp = eng.planner.plan(positions)
    assert offloaded == () and fp.shape.dense_prefill and fp.shape.chunk == MIN_PREFILL_CHUNK
    reply = eng.reply(prompt, sp)
    assert reply.tokens == want and reply.stats.prefill_chunk == MIN_PREFILL_CHUNK
    assert not any(p.disk_loads for p in reply.stats.phases)  # nothing read from disk


def test_with_every_weight_resident_a_budget_the_tightest_plan_fits_loads(q8_dir):
    """The load-time check of offload_weights=False counts the smallest prefill the
    planner takes (the smallest chunk, on the resident forms or one dense linear at a
    time, whichever holds less), not a wider chunk."""
    free = Engine(str(q8_dir), config=EngineConfig(policy="cpu"))
    edge = free.planner.edge_footprint()
    ways = [free.planner.footprint(1, chunk=MIN_PREFILL_CHUNK, dense_prefill=d, verify_rows=1).total for d in (False, True)]
    assert edge.total == min(ways) < free.planner.footprint(1).total
    budget = edge.total + 4096
    del free
    eng = Engine(str(q8_dir), budget=budget, config=EngineConfig(policy="cpu", offload_weights=False))
    assert eng.planner.edge_footprint().total <= budget
    with pytest.raises(BudgetExceeded):
        Engine(str(q8_dir), budget=edge.total - 64 * 1024, config=EngineConfig(policy="cpu", offload_weights=False))


def test_refused_when_even_offloading_cannot_fit(q8_dir):
    eng = Engine(str(q8_dir))
    floor = eng.planner.footprint(1, tuple(eng.swap.offload_order()))
    eng.budget.set(floor.total + 4096)
    with pytest.raises(BudgetExceeded) as err:
        list(eng.generate("x " * 200, SamplingParams(max_tokens=100)))
    e = err.value
    assert e.needed > e.budget and 0 < e.fits_positions < e.positions
    assert eng.cached_tokens == [] and eng.swap.offloaded == ()


def test_smollm2_below_its_weights_streams_token_identically(smollm2_gguf):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [{"role": "user", "content": "Name three colours."}]
    free = Engine(str(smollm2_gguf))
    expected = [c.token for c in free.generate(prompt, sp)]
    weights = free.swap.registry.total_bytes()
    del free
    budget = int(weights * 0.9)  # weights + KV + transients cannot all stay resident
    tight = Engine(str(smollm2_gguf), budget=budget, config=EngineConfig(policy="cpu"))  # free's weights
    chunks = list(tight.generate(prompt, sp))
    assert [c.token for c in chunks] == expected
    stats = chunks[-1].stats
    # the first token comes from prefill; each later one reads every offloaded layer once
    assert tight.swap.offloaded and stats.phases[1].disk_loads == 3 * len(tight.swap.offloaded)
    assert stats.memory.weights < budget

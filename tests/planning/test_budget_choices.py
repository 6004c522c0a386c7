"""What the engine chooses under a budget before any work: the weights form (from a
prediction of each form's bytes) and the prefill chunk (smaller before offloading layers)."""

import mlx.core as mx
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.memory import weight_bytes
from justfit.model.models import load
from justfit.planning.cost_model import MIN_PREFILL_CHUNK
from phaseswap.predict import predict_resident_bytes, predict_working_bytes
from tests.helpers.tiny_models import write_mlx_folder


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    # 4-bit stored weights with a tied head (vocab a multiple of 32: it gets a q8t form)
    return write_mlx_folder(tmp_path_factory.mktemp("budget") / "q4", "llama", seed=9, quantize_bits=4,
                            layers=3, vocab_size=288)


@pytest.mark.parametrize("policy,form", [("cpu", "q8t"), ("cpu-compact", "stored"), ("dense", "dense")])
def test_predicted_weight_bytes_are_what_the_registry_holds(q4_dir, policy, form):
    lazy = load(str(q4_dir), lazy=True).model
    predicted = predict_resident_bytes(lazy, form, mx.float32)
    working = predict_working_bytes(lazy)
    engine = Engine(str(q4_dir), config=EngineConfig(policy=policy))
    assert predicted == weight_bytes(engine.model) > 0
    if engine.policy.prefill == "dense":
        assert working == engine.swap.working_bytes() > 0


def test_auto_keeps_the_fast_weights_while_the_whole_context_fits(q4_dir, monkeypatch):
    import phaseswap.native

    fast = Engine(str(q4_dir), config=EngineConfig(policy="cpu"))
    whole = fast.planner.footprint(fast.context_limit, chunk=MIN_PREFILL_CHUNK).total
    if phaseswap.native.available():  # the stored weights at full speed, whatever the budget
        native = "cpu-int16" if phaseswap.native.rounded_available() else "cpu-native"
        assert Engine(str(q4_dir), budget=whole + 2**16).policy.name == native
        assert Engine(str(q4_dir), budget=whole - 2**16).policy.name == native
    monkeypatch.setattr(phaseswap.native, "kernels", lambda: None)  # without the kernel
    roomy = Engine(str(q4_dir), budget=whole + 2**16)
    assert roomy.policy.name == "cpu"
    tight = Engine(str(q4_dir), budget=whole - 2**16)
    assert tight.policy.name == "cpu-compact"
    assert tight.swap.registry.total_bytes() < 0.75 * fast.swap.registry.total_bytes()
    # an explicit policy is kept whatever the budget
    assert Engine(str(q4_dir), budget=whole - 2**16, config=EngineConfig(policy="cpu")).policy.name == "cpu"


def test_tight_budget_shrinks_the_prefill_chunk_before_offloading(q4_dir):
    prompt = list(range(3, 203)) * 2  # 400 tokens (the model holds 512)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    probe = Engine(str(q4_dir), config=EngineConfig(policy="cpu"))
    positions = len(prompt) + sp.max_tokens
    small = probe.planner.footprint(positions, chunk=MIN_PREFILL_CHUNK).total
    assert probe.planner.footprint(positions).total > small  # a 512-token chunk needs more
    engine = Engine(str(q4_dir), budget=small, config=EngineConfig(policy="cpu"))
    offloaded, fp = engine.planner.plan(positions)
    assert offloaded == () and MIN_PREFILL_CHUNK <= fp.shape.chunk < 512 and fp.total <= small
    reply = engine.reply(prompt, sp)
    got = reply.tokens
    assert reply.stats.prefill_chunk == fp.shape.chunk
    assert reply.stats.phases[0].peak_bytes <= small + mx.get_active_memory()  # MLX holds other tests' arrays too
    # the same chunk without a budget computes the same tokens: only the schedule changed
    same = Engine(str(q4_dir), config=EngineConfig(policy="cpu", prefill_chunk=fp.shape.chunk))
    assert [c.token for c in same.generate(prompt, sp) if c.token is not None] == got
    # without a budget the configured chunk is kept
    assert probe.planner.plan(positions)[1].shape.chunk == 512


def test_whole_process_budget_leaves_the_engine_what_the_process_does_not_hold(q4_dir):
    import justfit.memory as memory

    budget = 2**30
    engine = Engine(str(q4_dir), budget=budget, config=EngineConfig(policy="cpu", budget_covers_process=True))
    outside = memory.rss_bytes() - mx.get_active_memory()
    share = engine.budget.bytes
    assert 0 < budget - share and abs((budget - share) - outside) < 64 * 2**20
    list(engine.generate(list(range(3, 103)), SamplingParams(temperature=0, max_tokens=4)))
    # re-measured after the request, as a decaying maximum (tests/planning/test_outside_budget.py)
    assert 0 < engine.budget.bytes and abs(engine.budget.bytes - share) < 64 * 2**20
    engine.set_budget(budget)  # an engine-scope budget from then on
    assert engine.budget.bytes == budget
    list(engine.generate(list(range(3, 103)), SamplingParams(temperature=0, max_tokens=4)))
    assert engine.budget.bytes == budget

"""The outside share of a whole-process budget is a decaying maximum, not a ratchet:
after a spike and quiet requests the engine's share recovers; a sustained rise stays."""

import math
import time

import pytest

import justfit.planning.budget as outside_module
from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.errors import BudgetExceeded
from justfit.planning.budget import OutsideDecay, decayed_max, measure_outside
from tests.helpers.tiny_models import write_mlx_folder

MiB = 2**20


def test_a_spike_decays_back_to_the_quiet_level():
    quiet, spike = 100 * MiB, 400 * MiB
    est = decayed_max(quiet, spike)
    assert est == spike  # taken at once
    history = []
    for _ in range(40):
        est = decayed_max(est, quiet)
        history.append(est)
    assert all(a >= b >= quiet for a, b in zip(history, history[1:]))  # never below the latest sample
    assert history[7] - quiet == pytest.approx((spike - quiet) / 2, rel=1e-6)  # the excess halves in 8
    assert history[-1] - quiet < (spike - quiet) / 30


def test_a_sustained_rise_is_honoured_from_its_first_request():
    est = 100 * MiB
    for _ in range(50):
        est = decayed_max(est, 130 * MiB)
        assert est == 130 * MiB


def test_half_life_sets_the_pace_and_must_be_positive():
    fast, slow = OutsideDecay(half_life=1), OutsideDecay(half_life=32)
    assert decayed_max(200, 100, fast) == 150 and decayed_max(200, 100, slow) >= 197
    with pytest.raises(ValueError, match="half_life"):
        OutsideDecay(half_life=0)


def test_measure_outside_is_what_the_process_holds_besides_mlx():
    import mlx.core as mx

    from justfit.memory import peak_rss_bytes, rss_bytes

    settled = measure_outside()
    assert 0 < settled <= rss_bytes()
    # a request that raised the high-water mark: the mark less its MLX peak counts
    assert measure_outside(high_water=0, mlx_peak=mx.get_active_memory() + 1) >= \
        min(settled, peak_rss_bytes() - mx.get_active_memory() - 1) > 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("outside") / "llama", "llama", seed=3, layers=2)


def test_engine_share_recovers_after_a_spike_and_honours_a_rise(tiny_dir, monkeypatch):
    outside = {"now": 64 * MiB}
    monkeypatch.setattr(outside_module, "measure_outside", lambda high_water=0, mlx_peak=0, seen=0: outside["now"])
    prompt, sp = list(range(3, 103)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    free = Engine(str(tiny_dir), config=EngineConfig(policy="cpu"))
    need = free.planner.footprint(len(prompt) + sp.max_tokens).total
    held = free.grammars.bound_bytes  # set aside from load for constrained output (justfit.engine.grammar)
    slack = 4 * MiB
    budget = 64 * MiB + held + need + slack
    engine = Engine(str(tiny_dir), budget=budget, config=EngineConfig(policy="cpu", budget_covers_process=True))
    share = engine.budget.bytes
    assert share == budget - 64 * MiB - held
    engine.complete(prompt, sp)
    assert engine.budget.bytes == share

    spike = budget  # outside the engine, more than the whole budget for one request
    outside["now"] = 64 * MiB + spike
    engine.complete(prompt, sp)  # ran before the spike was seen; measured after it
    assert engine.budget.bytes == share - spike
    outside["now"] = 64 * MiB
    # refused requests count as quiet ones: the spike's excess halves every 8 of them
    refused = 0
    while True:
        try:
            engine.complete(prompt, sp)
            break
        except BudgetExceeded:
            refused += 1
            assert refused < 200, "the share never recovered"
    # the request fits once the excess left is below the slack (planning may fit it a bit sooner)
    assert 8 * math.log2(spike / share) - 1 <= refused <= math.ceil(8 * math.log2(spike / slack))
    for _ in range(80):
        engine.complete(prompt, sp)
    assert share - MiB <= engine.budget.bytes <= share

    outside["now"] = 64 * MiB + 3 * MiB  # a sustained rise: taken at once, and kept
    for _ in range(3):
        engine.complete(prompt, sp)
        assert engine.budget.bytes == share - 3 * MiB


def test_a_peak_outside_mlx_under_an_earlier_high_water_mark_still_counts(tiny_dir):
    """Once an earlier, larger peak set the kernel's lifetime mark, a request's own peak
    besides MLX no longer shows in it; the watch sampling while the request runs does."""
    from justfit.memory import peak_rss_bytes

    earlier = b"\x01" * (256 * MiB)  # touched: the process's lifetime mark goes above what follows
    del earlier
    engine = Engine(str(tiny_dir), budget=1 << 30, config=EngineConfig(policy="cpu", budget_covers_process=True))
    prompt, sp = list(range(3, 103)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.complete(prompt, sp)
    quiet = engine.budget.bytes
    held = []

    def progress(done, total):  # mid-request, 48 MiB besides MLX for a while, then gone
        if not held:
            held.append(b"\x01" * (48 * MiB))
            time.sleep(0.1)
            held[0] = None

    mark = peak_rss_bytes()
    list(engine.generate(prompt, sp, progress=progress))
    assert peak_rss_bytes() == mark  # the kernel's mark could not have shown it
    assert engine.budget.bytes <= quiet - 40 * MiB

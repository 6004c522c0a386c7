"""Verifying drafts (justfit.engine.speculate): greedy acceptance stops at the first token the
model would not pick; sampled acceptance emits each token with the target
distribution's probabilities (chi-square tests over seeded draws), the first one as
plain sampling does, and moves the RNG position once per emitted token."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from justfit.config import SamplingParams
from justfit.engine.sampling import keyed_sampler, sampling_logprobs
from justfit.engine.speculate import accept_uniform, greedy_accept, sampled_accept

# The chi-square distribution's upper 0.001 quantiles, by degrees of freedom: a correct
# sampler fails a test with probability 0.001.
CHI2_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _logits_with_argmax(choices: list[int], vocab: int = 11, seed: int = 0) -> mx.array:
    rows = np.random.default_rng(seed).normal(size=(len(choices), vocab)).astype(np.float32)
    rows[np.arange(len(choices)), choices] = rows.max() + 1.0
    return mx.array(rows)


@pytest.mark.parametrize("draft, expected", [
    ([3, 7, 1], (3, 9)),  # all accepted: the bonus token from the last row
    ([4, 7, 1], (0, 3)),  # the first differs: the model's own first token
    ([3, 7, 2], (2, 1)),  # stops in the middle
    ([], (0, 3)),  # no draft: plain decoding
])
def test_greedy_accept(draft, expected):
    logits = _logits_with_argmax([3, 7, 1, 9][:len(draft) + 1])
    assert greedy_accept(logits, draft) == expected


P0 = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
P1 = np.array([0.1, 0.3, 0.25, 0.05, 0.3])
P2 = np.array([0.2, 0.2, 0.2, 0.2, 0.2])


def _emitted(draft: list[int], draws: int) -> list[list[int]]:
    """Tokens sampled_accept emits with `draft` against rows P0, P1, P2, over `draws` seeds."""
    logprobs = mx.log(mx.array(np.stack([P0, P1, P2][:len(draft) + 1]), dtype=mx.float32))
    out = []
    for seed in range(draws):
        rng = {"seed": seed, "step": 0}
        n, token = sampled_accept(logprobs, draft, rng)
        assert rng["step"] == n + 1
        out.append(draft[:n] + [token])
    return out


def test_sampled_tokens_follow_the_target_distribution():
    emitted = _emitted([0, 3], 3000)  # a likely draft token, then an unlikely one
    first = np.bincount([e[0] for e in emitted], minlength=5)
    assert _chi2(first, P0) < CHI2_001[4]
    # after the first drafted token held, the second is distributed as P1 (the unlikely
    # 3 accepted about as often as P1 says)
    second = np.bincount([e[1] for e in emitted if e[0] == 0 and len(e) > 1], minlength=5)
    assert second.sum() > 1000
    assert _chi2(second, P1) < CHI2_001[4]
    # when both held, the bonus token comes from P2
    bonus = np.bincount([e[2] for e in emitted if len(e) == 3], minlength=5)
    assert bonus.sum() > 50 and _chi2(bonus, P2) < CHI2_001[4]


def test_first_token_is_distributed_as_plain_sampling():
    """Two-sample chi-square: keyed_sampler's draws from the raw logits against the first
    token sampled_accept emits from sampling_logprobs of the same logits."""
    sp = SamplingParams(temperature=0.7, top_p=0.95, top_k=5)
    logits = mx.array(np.random.default_rng(3).normal(0, 0.7, size=(2, 8)).astype(np.float32))
    raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target = sampling_logprobs(sp, raw)
    probs = np.exp(np.array(target[0]))
    kept = probs > 0
    assert abs(probs.sum() - 1) < 1e-5 and 2 <= kept.sum() <= 5  # top-k and top-p dropped the rest
    draft = [int(mx.argmax(raw[0]).item())]
    draws = 2500
    plain, spec = np.zeros(8), np.zeros(8)
    for seed in range(draws):
        plain[int(keyed_sampler(sp, 8, {"seed": seed, "step": 0})(raw[:1]).item())] += 1
        n, token = sampled_accept(target, draft, {"seed": seed + draws, "step": 0})
        spec[draft[0] if n else token] += 1
    assert plain[~kept].sum() == spec[~kept].sum() == 0
    total = plain[kept] + spec[kept]
    stat = sum(((obs - total / 2) ** 2 / (total / 2)).sum() for obs in (plain[kept], spec[kept]))
    assert stat < CHI2_001[int(kept.sum()) - 1]
    assert _chi2(spec[kept], probs[kept]) < CHI2_001[int(kept.sum()) - 1]


def test_same_position_same_tokens_and_one_step_per_token():
    logprobs = mx.log(mx.array(np.stack([P0, P1, P2]), dtype=mx.float32))
    results = set()
    for _ in range(3):
        rng = {"seed": 42, "step": 17}
        n, token = sampled_accept(logprobs, [0, 1], rng)
        results.add((n, token, rng["step"]))
    assert len(results) == 1
    n, _, step = results.pop()
    assert step == 17 + n + 1


def test_a_certain_draft_is_always_accepted():
    logprobs = mx.array([[0.0, -math.inf, -math.inf], [-math.inf, 0.0, -math.inf], [-1.0, -1.0, -1.2]])
    for seed in range(50):
        n, _ = sampled_accept(logprobs, [0, 1], {"seed": seed, "step": 0})
        assert n == 2


def test_acceptance_uniforms_are_uniform_and_apart_from_the_sampler_keys():
    u = np.array([accept_uniform(5, s) for s in range(4000)])
    assert 0 <= u.min() and u.max() < 1
    counts = np.histogram(u, bins=8, range=(0, 1))[0]
    assert _chi2(counts, np.full(8, 1 / 8)) < CHI2_001[7]
    assert accept_uniform(5, 1) != accept_uniform(6, 1) != accept_uniform(5, 2)


def test_sampling_logprobs_apply_keyed_samplers_filters():
    sp = SamplingParams(temperature=0.5, top_p=1.0, top_k=2)
    raw = mx.log(mx.array([[0.6, 0.3, 0.1]]))
    got = np.exp(np.array(sampling_logprobs(sp, raw)[0]))
    want = np.array([0.6 ** 2, 0.3 ** 2, 0]) / (0.6 ** 2 + 0.3 ** 2)
    assert np.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError):
        sampling_logprobs(SamplingParams(temperature=0), raw)

"""When a sequence verifies drafts (justfit.engine.drafting.DraftPolicy): drafts that keep
failing stop at once and are probed rarely; drafts that keep holding go on and grow."""

from __future__ import annotations

from justfit.engine.drafting import LONGEST_PROBE_GAP, PROBE_AFTER, DraftPolicy
from justfit.engine.speculate import StepCosts, draft_length


class _Proposer:
    """Proposes `length` tokens every time, as matched by an n-gram of `matched` tokens."""

    max_draft = 16
    active = True

    def __init__(self, matched: int = 2, length: int = 16):
        self.matched, self.length = matched, length

    def propose(self, limit: int) -> list[int]:
        return list(range(min(limit, self.length)))

    def extend(self, tokens: list[int]) -> None:
        pass

    def feedback(self, drafted: int, accepted: int) -> None:
        pass


def _cpu_costs() -> StepCosts:
    """Steps whose cost grows with their rows as on a CPU (2 rows 1.2x, 4 rows 1.6x, 9 rows 4x)."""
    costs = StepCosts()
    for rows, seconds in ((1, 0.010), (2, 0.012), (4, 0.016), (9, 0.040), (17, 0.080)):
        costs.note(rows, seconds)
        costs.note(rows, seconds)
    return costs


def _run(policy: DraftPolicy, steps: int, accept) -> tuple[int, int]:
    """`steps` decode steps; `accept(drafted)` says how many of a draft hold. Returns
    (verifies, drafted tokens)."""
    verifies = drafted = 0
    for _ in range(steps):
        draft = policy.draft(16)
        if draft:
            policy.verified(len(draft), accept(len(draft)))
            verifies += 1
            drafted += len(draft)
    return verifies, drafted


def test_drafts_that_always_fail_stop_after_a_few_verifies_and_are_probed_ever_more_rarely():
    policy = DraftPolicy(_Proposer(matched=2), _cpu_costs())
    verifies, drafted = _run(policy, 5000, lambda k: 0)
    # a few verifies to learn the acceptance, then one-token probes at growing gaps
    # (64, 128, ... up to 1,024 declined drafts): far fewer than one per 64 steps
    assert verifies <= 12
    assert drafted <= 2 * verifies
    assert policy.probe_after == LONGEST_PROBE_GAP


def test_drafts_that_always_hold_go_on_and_grow():
    policy = DraftPolicy(_Proposer(matched=4), _cpu_costs())
    verifies, drafted = _run(policy, 200, lambda k: k)
    assert verifies == 200
    assert drafted > 2 * verifies  # longer than one token once the drafts keep holding


def test_failures_of_short_matches_do_not_stop_long_ones():
    proposer = _Proposer(matched=2)
    policy = DraftPolicy(proposer, _cpu_costs())
    _run(policy, 300, lambda k: 0)  # prose: two-token matches never hold
    proposer.matched = 4
    verifies, _ = _run(policy, 50, lambda k: k)  # then a copy: four-token matches do
    assert verifies == 50


def test_a_probe_that_holds_brings_the_short_gap_back():
    policy = DraftPolicy(_Proposer(matched=2), _cpu_costs())
    _run(policy, 1000, lambda k: 0)
    assert policy.probe_after > PROBE_AFTER
    _run(policy, policy.probe_after, lambda k: k)  # the next probe holds
    assert policy.probe_after == PROBE_AFTER


def test_draft_length_needs_a_margin_over_a_plain_step():
    costs = _cpu_costs()
    assert draft_length(16, 0.0, costs) == 0
    assert draft_length(16, 0.25, costs) == 0  # 1.25 tokens for 1.2x the time: no margin left
    assert draft_length(16, 0.25, costs, margin=0.0) == 1
    assert draft_length(16, 0.9, costs) > 1
    assert draft_length(16, 0.9, StepCosts()) == 0  # nothing measured yet: a plain step first

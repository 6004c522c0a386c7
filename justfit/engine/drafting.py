"""When a decoding sequence verifies drafted tokens, and how many: its drafter
(justfit.engine.draft's interface), the acceptance it has seen, and the measured cost of
wider steps (justfit.engine.speculate.draft_length) weighed against it."""

from __future__ import annotations

from typing import Callable

from justfit.engine.draft import NgramDrafter
from justfit.engine.speculate import StepCosts, TokenAcceptance, draft_length

PROBE_AFTER = 64  # drafts declined in a row before a one-token one is verified anyway
LONGEST_PROBE_GAP = 1024  # each probe that fails doubles the wait for the next, up to this

DrafterFactory = Callable[[list[int]], NgramDrafter]


def ngram_drafter(tokens: list[int]) -> NgramDrafter:
    """The default: the n-gram drafter proposing all it has, `DraftPolicy` weighing the length."""
    return NgramDrafter(tokens, adapt_length=False)


class DraftPolicy:
    """One sequence's drafting: `draft(limit)` proposes the tokens to verify after the
    pending one ([]: a plain step); `saw` and `verified` keep it up to date."""

    def __init__(self, drafter: NgramDrafter, step_costs: StepCosts):
        self.drafter, self.step_costs = drafter, step_costs
        # How likely drafted tokens are accepted, per length of the n-gram the draft
        # matched: in prose a two-token match (a common word pair) rarely leads where the
        # model goes, a four-token one in copied text mostly does, and one average over
        # both would draft prose's misses or decline the copies.
        self.by_match: dict[int, TokenAcceptance] = {}
        self.declined = 0  # drafts proposed and not verified since the last verify
        self.probe_after = PROBE_AFTER
        self.matched = 0  # the n-gram length of the draft being verified
        self.probing = False  # whether that draft is a probe

    def acceptance(self, matched: int) -> TokenAcceptance:
        """The acceptance seen for drafts that matched `matched` tokens."""
        if matched not in self.by_match:
            self.by_match[matched] = TokenAcceptance()
        return self.by_match[matched]

    @property
    def max_draft(self) -> int:
        """The most tokens one draft proposes."""
        return self.drafter.max_draft

    def saw(self, token: int) -> None:
        """A token of the reply, sampled or accepted."""
        self.drafter.extend([token])

    def draft(self, limit: int) -> list[int]:
        """At most `limit` tokens to verify in the next step ([] for a plain step)."""
        d = self.drafter
        if not d.active:
            return []
        proposal = d.propose(limit) if limit > 0 else []
        if not proposal:
            return []
        matched = getattr(d, "matched", 0)  # a drafter that does not say: one tracker for all
        k = draft_length(len(proposal), self.acceptance(matched).rate, self.step_costs)
        self.probing = False
        if not k:
            # Declined while a step of more rows costs more than the tokens it is likely to
            # add; now and then one token measures the acceptance again, rarer after each
            # probe that fails, so text with nothing to copy pays almost nothing.
            self.declined += 1
            if self.declined >= self.probe_after and self.step_costs.cost(1) is not None:
                k, self.probing = 1, True
        if k:
            self.declined = 0
            self.matched = matched
        return proposal[:k]

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of `drafted` tokens."""
        self.drafter.feedback(drafted, accepted)
        self.acceptance(self.matched).add(drafted, accepted)
        if self.probing:
            self.probe_after = PROBE_AFTER if accepted else min(LONGEST_PROBE_GAP, 2 * self.probe_after)

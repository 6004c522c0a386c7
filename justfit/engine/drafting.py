"""When a decoding sequence verifies drafted tokens, and how many: its drafter
(justfit.engine.draft's interface), the acceptance it has seen, and the measured cost of
wider steps (justfit.engine.speculate.draft_length) weighed against it."""

from __future__ import annotations

from typing import Callable

from justfit.engine.draft import NgramDrafter
from justfit.engine.speculate import StepCosts, TokenAcceptance, draft_length

PROBE_AFTER = 64  # drafts declined in a row before a short one is verified anyway

DrafterFactory = Callable[[list[int]], NgramDrafter]


def ngram_drafter(tokens: list[int]) -> NgramDrafter:
    """The default: the n-gram drafter proposing all it has, `DraftPolicy` weighing the length."""
    return NgramDrafter(tokens, adapt_length=False)


class DraftPolicy:
    """One sequence's drafting: `draft(limit)` proposes the tokens to verify after the
    pending one ([]: a plain step); `saw` and `verified` keep it up to date."""

    def __init__(self, drafter: NgramDrafter, step_costs: StepCosts):
        self.drafter, self.step_costs = drafter, step_costs
        self.acceptance = TokenAcceptance()  # how likely its drafted tokens are accepted
        self.declined = 0  # drafts proposed and not verified since the last verify

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
        k = draft_length(len(proposal), self.acceptance.rate, self.step_costs)
        if proposal and not k:
            # Declined while a step of more rows costs more than the tokens it is likely to
            # add; now and then a short one measures the acceptance again.
            self.declined += 1
            if self.declined >= PROBE_AFTER and self.step_costs.cost(1) is not None:
                k = min(len(proposal), 2)
        if k:
            self.declined = 0
        return proposal[:k]

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of `drafted` tokens."""
        self.drafter.feedback(drafted, accepted)
        self.acceptance.add(drafted, accepted)

"""Draft tokens for speculative decoding without a draft model: prompt lookup.

A reply that repeats part of its context (code shown in the prompt and edited, a file
quoted back, a tool's output restated) can be guessed from the context itself: find the
most recent earlier occurrence of the sequence's last few tokens and propose what
followed it. The model then checks the guess in one forward pass (justfit.engine.speculate).

The index maps every n-gram (min_ngram .. max_ngram tokens) to the position right after
its most recent occurrence, kept up to date token by token: an n-gram enters the index
only once the token after it is known, so the sequence's own suffix never matches itself.
Looking up and extending cost O(new tokens + draft), whatever the sequence's length.

How many tokens to propose adapts to what the model accepts: a fully accepted draft
doubles the next one, a rejected one shrinks it to just past what was accepted. Where
guesses keep failing (prose), drafting switches off for a while, each time longer, so
text with nothing to copy pays almost nothing; it probes again after the pause.

How to tune the defaults: record greedy replies on bench.speculation's workloads (code
edits, prose, an agent's turns), replay each through the drafter with `replay` below
(tokens emitted per forward pass, drafted tokens thrown away) for each setting, and
confirm the best in bench.speculation's wall times. The n-gram lengths (4 down to 2) and
the draft cap (16) are the usual prompt-lookup settings; they are not yet tuned that way.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_BITS = 32  # a token id's width in a packed n-gram key
MAX_DRAFT = 16  # the most tokens one draft proposes (the planner counts a verify step of 1 + this)


@dataclass
class Acceptance:
    """Recent acceptance: an exponential average of accepted / drafted per verify."""

    rate: float = 1.0
    verifies: int = 0
    weight: float = 0.3  # how much one verify moves the average

    def add(self, drafted: int, accepted: int) -> None:
        """Count one verify that accepted `accepted` of `drafted` tokens."""
        self.rate += self.weight * (accepted / drafted - self.rate)
        self.verifies += 1


class NgramDrafter:
    """Prompt-lookup drafts for one sequence (see the module doc)."""

    # Drafting pauses when the average acceptance falls below this, after `warmup` verifies.
    low_rate = 0.25
    warmup = 3
    first_pause = 32  # tokens the first pause lasts; each pause in a row doubles it
    longest_pause = 1024

    def __init__(self, tokens: list[int], max_ngram: int = 4, min_ngram: int = 2, max_draft: int = MAX_DRAFT,
                 adapt_length: bool = True):
        if not 1 <= min_ngram <= max_ngram <= 15:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_ngram <= max_ngram <= 15, not {min_ngram}, {max_ngram}")
        if max_draft < 1:
            raise ValueError(f"max_draft must be at least 1, not {max_draft}")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft
        # False: always propose up to max_draft (a caller that weighs the length itself,
        # as justfit.engine.speculate.draft_length does with measured step costs)
        self.adapt_length = adapt_length
        self.tokens: list[int] = []
        # n-gram -> the position after its latest earlier occurrence; an n-gram's key packs
        # its tokens into one int with n in the low bits (a third less memory than tuples)
        self.index: dict[int, int] = {}
        self.tail = 0  # the last max_ngram tokens, packed
        self._masks = [(1 << (TOKEN_BITS * n)) - 1 for n in range(max_ngram + 1)]
        self.draft_len = max(1, max_draft // 2) if adapt_length else max_draft
        self.acceptance = Acceptance()
        self.paused_for = 0  # tokens left before drafting resumes
        self.pause = self.first_pause
        self.matched = 0  # the n-gram length the last proposal matched (0: none)
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Tokens appended to the sequence (the prompt at first, then accepted reply tokens)."""
        seq, index = self.tokens, self.index
        lo, hi = self.min_ngram, self.max_ngram
        for t in tokens:
            end = len(seq)  # the n-grams ending just before `t` are now followed by it
            for n in range(lo, min(hi, end) + 1):
                index[self._key(n)] = end
            seq.append(t)
            self.tail = ((self.tail << TOKEN_BITS) | t) & self._masks[hi]
        if self.paused_for:
            self.paused_for = max(0, self.paused_for - len(tokens))

    def _key(self, n: int) -> int:
        """The index key of the sequence's last n tokens."""
        return ((self.tail & self._masks[n]) << 4) | n

    @property
    def active(self) -> bool:
        """Whether drafting is on (not paused for low acceptance)."""
        return self.paused_for == 0

    def propose(self, limit: int) -> list[int]:
        """At most min(limit, the current draft length) tokens that followed the most
        recent earlier occurrence of the longest suffix found (max_ngram down to
        min_ngram); [] when nothing matches or drafting is paused."""
        k = min(limit, self.draft_len)
        seq = self.tokens
        self.matched = 0
        if k <= 0 or not self.active:
            return []
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            at = self.index.get(self._key(n))
            if at is not None:
                self.matched = n
                return continuation(seq, at, k)
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        """After a verify of `drafted` tokens of which the first `accepted` held: adapt
        the draft length, and pause drafting while recent acceptance stays low."""
        if drafted <= 0:
            return
        if not self.adapt_length:
            self.draft_len = self.max_draft
        elif accepted >= drafted:
            self.draft_len = min(self.max_draft, max(self.draft_len, 2 * drafted))
        else:
            self.draft_len = max(1, accepted + 1)
        self.acceptance.add(drafted, accepted)
        if self.acceptance.verifies >= self.warmup and self.acceptance.rate < self.low_rate:
            self.paused_for = self.pause
            self.pause = min(self.longest_pause, 2 * self.pause)
            # the probe after the pause starts afresh, but one more failure pauses again
            self.acceptance = Acceptance(rate=self.low_rate, verifies=self.warmup)
            self.draft_len = max(1, self.max_draft // 4) if self.adapt_length else self.max_draft
        elif accepted > 0 and self.acceptance.rate >= 2 * self.low_rate:
            self.pause = self.first_pause  # drafting pays again: a later slump starts with a short pause


def continuation(seq: list[int], at: int, k: int) -> list[int]:
    """The k tokens from `at` on; where they run past the sequence's end, the pattern
    from `at` repeats (a loop of period len(seq) - at, as the match says it is)."""
    out = seq[at:at + k]
    period = len(seq) - at
    while len(out) < k:
        out.append(out[len(out) - period] if len(out) >= period else seq[at + len(out)])
    return out


@dataclass
class Replay:
    """What drafting would have done for a reply already produced: verifies (forward
    passes of the model), tokens they emitted, and drafted tokens proposed and accepted."""

    verifies: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per forward pass (1.0: no gain)."""
        return self.emitted / self.verifies if self.verifies else 0.0


def replay(prompt: list[int], reply: list[int], limit: int = 16, **drafter_args) -> Replay:
    """Drive a drafter over `prompt` + `reply` as greedy decoding with verification
    would: each pass accepts the draft's longest prefix equal to the reply's next tokens
    and emits one more (the model's own token)."""
    d = NgramDrafter(prompt, **drafter_args)
    out = Replay()
    i = 0
    while i < len(reply):
        draft = d.propose(min(limit, len(reply) - i - 1))
        n = 0
        while n < len(draft) and draft[n] == reply[i + n]:
            n += 1
        if draft:
            d.feedback(len(draft), n)
        d.extend(reply[i:i + n + 1])
        out.verifies += 1
        out.emitted += n + 1
        out.drafted += len(draft)
        out.accepted += n
        i += n + 1
    return out

"""Verifying draft tokens (justfit.engine.draft) against the model, independent of the model.

After one forward pass over [last token] + draft (k tokens), row i of its output is
the model's next-token distribution after draft[:i]; rows 0 .. k. A draft token that
the model would itself have produced is accepted; the first one it would not have
produced ends the run, and the model's own token at that row replaces it; if all k
hold, row k gives one more token (the bonus). Each verify emits accepted + 1 tokens.

Greedy: accepted while the draft equals the argmax, so the reply is the one plain
greedy decoding produces (as far as the verify pass's logits equal one-at-a-time ones).

Sampling: the speculative-sampling rule for a deterministic draft (a point mass q on
d_i): accept d_i with probability min(1, p_i(d_i) / q(d_i)) = p_i(d_i); on rejection
draw from the residual max(0, p_i - q), which is p_i with d_i removed, renormalized.
Each emitted token is then distributed exactly as p_i: the reply's distribution is
plain sampling's. Randomness comes from the request's RNG position (justfit.engine.sampling):
the token at step s uses the uniform `accept_uniform(seed, s)` (its own derivation,
never one of the sampler's keys) and draws with the sampler's key for s; `rng["step"]`
advances once per emitted token, so a restored conversation goes on identically.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import mlx.core as mx

from justfit.engine.sampling import step_key


def greedy_accept(logits: mx.array, draft: list[int]) -> tuple[int, int]:
    """(n, token): how many draft tokens equal the argmax at their row (the first n),
    and the argmax at row n, the token that follows them. `logits` [k + 1, vocab]."""
    choices = mx.argmax(logits, axis=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    return n, choices[n]


def accept_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that decides whether the draft token at `step` is accepted:
    hashed from (seed, step) with its own salt, apart from the sampler's keys."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8, person=b"jf-accept").digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sampled_accept(logprobs: mx.array, draft: list[int], rng: dict,
                   sample: Callable[[mx.array], mx.array] | None = None) -> tuple[int, int]:
    """(n, token): the first n draft tokens accepted by the speculative-sampling rule,
    then the token drawn at row n (from the residual after a rejection, from row k when
    all held); advances rng["step"] by n + 1. `logprobs` [k + 1, vocab] are the final
    normalized distributions (justfit.engine.sampling.sampling_logprobs). `sample`, given a
    row of log-probabilities, draws one token with the key for rng's current step; by
    default mx.random.categorical with justfit.engine.sampling.step_key, the sampler's own draw."""
    k = len(draft)
    if logprobs.shape[0] != k + 1:
        raise ValueError(f"{logprobs.shape[0]} rows of log-probabilities for a draft of {k}: need {k + 1}")
    draw = sample or (lambda row: mx.random.categorical(row, key=step_key(rng["seed"], rng["step"])))
    probs = mx.exp(logprobs[mx.arange(k), mx.array(draft, dtype=mx.int32)]).tolist() if k else []
    n = 0
    while n < k:
        row = logprobs[n]
        if accept_uniform(rng["seed"], rng["step"]) >= probs[n]:
            residual = mx.concatenate([row[:draft[n]], mx.array([-float("inf")], row.dtype), row[draft[n] + 1:]])
            if mx.isfinite(residual).any().item():  # else all the mass is on d_n (p rounded below 1): it stands
                row = residual - mx.logsumexp(residual, keepdims=True)
                break
        rng["step"] += 1
        n += 1
    else:
        row = logprobs[k]
    token = int(draw(row).item())
    rng["step"] += 1
    return n, token


# -- how many drafted tokens a step should verify ----------------------------------
#
# A step that feeds r positions costs more than one that feeds one: on a GPU little (the
# weights are read once either way), on a CPU nearly in proportion at first (each row is
# its own arithmetic). A draft pays only when the tokens it is expected to add outweigh
# that: `draft_length` weighs both with the step costs this engine measured.

PRIOR_SLOPE = 0.25  # a step's extra cost per extra row, as a share of a one-row step, until measured


class StepCosts:
    """Seconds a decode step takes by the positions it feeds, measured as steps run
    (an exponential average per row count, counted once measured twice: a shape's first
    step may pay one-off costs); rows not yet measured are interpolated between
    measured ones, or extrapolated at PRIOR_SLOPE."""

    def __init__(self, weight: float = 0.2):
        self.measured: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self.weight = weight

    @property
    def seconds(self) -> dict[int, float]:
        """The row counts measured at least twice, and their average seconds."""
        return {r: s for r, s in self.measured.items() if self.samples[r] >= 2}

    def note(self, rows: int, seconds: float) -> None:
        """Count a step that fed `rows` positions in `seconds`."""
        n = self.samples.get(rows, 0)
        old = self.measured.get(rows)
        # the first two steps weigh equally; then an exponential average
        self.measured[rows] = seconds if old is None else old + max(self.weight, 1 / (n + 1)) * (seconds - old)
        self.samples[rows] = n + 1

    def cost(self, rows: int) -> float | None:
        """The seconds a step of `rows` positions is expected to take (None: nothing measured)."""
        seconds = self.seconds
        if rows in seconds:
            return seconds[rows]
        if not seconds:
            return None
        known = sorted(seconds)
        one = seconds[known[0]] / (1 + PRIOR_SLOPE * (known[0] - 1))  # a one-row step, from the nearest
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            return seconds[lo] + (seconds[hi] - seconds[lo]) * (rows - lo) / (hi - lo)
        if below:
            return seconds[below[-1]] + PRIOR_SLOPE * one * (rows - below[-1])
        return max(one, seconds[above[0]] - PRIOR_SLOPE * one * (above[0] - rows))


# A draft must beat a plain step by this share of its tokens per second: the step costs
# time the forward pass alone (not the acceptance check and the rollback of rejected
# positions), and on a shared machine they are noisy; a draft that only ties is a loss.
MARGIN = 0.1


def draft_length(proposed: int, acceptance: float, costs: StepCosts, margin: float = MARGIN) -> int:
    """How many of `proposed` drafted tokens to verify: the length that makes the most
    tokens per second, each drafted token accepted with probability `acceptance` if the
    one before it was (so a step yields 1 + a + a^2 + ... tokens); 0 when none beats a
    plain step by `margin` (a share of its rate)."""
    plain = costs.cost(1)
    if plain is None or proposed <= 0:
        return 0  # a plain step first: it measures what a draft must beat
    best, best_rate, expected = 0, (1.0 + margin) / plain, 1.0
    for k in range(1, proposed + 1):
        expected += acceptance ** k
        cost = costs.cost(k + 1)
        if cost is not None and expected / cost > best_rate:
            best, best_rate = k, expected / cost
    return best


class TokenAcceptance:
    """The chance that a drafted token is accepted given the ones before it were, from
    each verify's accepted run and whether it ended in a rejection (exponential averages
    over verifies). Copying comes in runs: after a draft accepted whole the next one
    mostly is too, after a rejection less often, so each case keeps its own rate and
    `rate` is the one for the case the sequence is in. Until a draft is accepted whole
    the rate starts at `prior_cold`, a coin toss: prose, where n-grams match often and
    the model seldom follows them, stops drafting after a verify or two, while a copy's
    first accepted draft moves it to the warm case at once."""

    def __init__(self, prior: float = 0.8, weight: float = 0.25, prior_cold: float = 0.5):
        self.rates = {True: prior, False: prior_cold}  # after a draft accepted whole / after a rejection
        self.whole = False  # whether the last verify accepted its whole draft
        self.weight = weight

    @property
    def rate(self) -> float:
        """The acceptance expected for the next draft's tokens."""
        return self.rates[self.whole]

    def add(self, drafted: int, accepted: int) -> None:
        """Count a verify that accepted the first `accepted` of `drafted` tokens."""
        if drafted <= 0:
            return
        trials = accepted + (accepted < drafted)
        self.rates[self.whole] += self.weight * (accepted / trials - self.rates[self.whole])
        self.whole = accepted == drafted

"""What turns a sequence's logits into its reply: the request's sampler and logits
processors, its stop text (justfit.engine.stops.ReplyText) and log-probabilities. A
`Decoder` is built once the prompt is in (`accept` takes the first token's logits).

With an output constraint (a grammar: justfit.engine.grammar.Constrained) the matcher
takes every token as it is decided, and:

- the tokens the grammar does not allow get -inf logits before anything else looks at
  them (after the penalties, before top-p, min-p, top-k and the temperature), so a
  sampled token follows the model's distribution renormalized over the allowed ones;
  greedy takes the argmax of the masked logits. The log-probabilities reported are
  the masked distribution's.
- where the grammar forces tokens (`forced`), they are taken without sampling (each
  advances the sampler's position as one draw would, so a seeded reply does not depend
  on how they were fed), counted in `GenerationStats.forced_tokens`; the sequence
  feeds them with its next forward (justfit.engine.sequence), or one a step when
  `SamplingParams.force_tokens` is off. A forced token's log-probability is 0.
- drafted tokens are checked against the grammar before a verify (`guessable`), and
  the verify's rows masked, each after the drafted tokens before it.
- the reply ends ("stop") once the grammar is satisfied and takes nothing more, or at
  one of its end tokens; the token limit ends it with "length" and the partial text.

A mask needs the token before it: computing it waits for the sampled token on the
host, which the sampler already did (`.item()`), so it adds its own time to each
step (docs/SERVING.md, "Structured output", says how much)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from dataclasses import dataclass

from justfit.config import SamplingParams
from justfit.engine.generate import token_logprobs
from justfit.engine.grammar import Constrained, apply_mask
from justfit.engine.sampling import keyed_sampler, logits_processors, sampling_logprobs
from justfit.engine.speculate import greedy_accept, sampled_accept
from justfit.engine.stats import Chunk, GenerationStats
from justfit.engine.stops import ReplyText


@dataclass
class Pick:
    """A decided token: its distribution's log-probabilities (when known), whether the
    grammar forced it, and whether the grammar ended with it."""

    token: int
    logprobs: mx.array | None = None
    forced: bool = False
    ends: bool = False


class Decoder:
    """Sampling and stop text for one reply: `accept(logits)` samples a token and
    returns its chunk; `finish_reason` on a chunk says the reply ended there."""

    def __init__(self, tokenizer, sp: SamplingParams, stats: GenerationStats, prompt: list[int], vocab: int,
                 rng: dict, grammar: Constrained | None = None):
        self.sp, self.rng, self.stats, self.grammar = sp, rng, stats, grammar
        self.reply = ReplyText(tokenizer, sp, stats)
        self.sampler = keyed_sampler(sp, vocab, rng)
        self.processors = logits_processors(sp, len(prompt))
        self.context = mx.array(prompt)  # what the processors see: prompt and reply so far
        # Greedy with nothing to adjust or report: the argmax of the logits is the token
        # (the normalizing logsumexp over the vocabulary is a cost every token on the CPU).
        self.plain = self.sampler is greedy_sampler and not self.processors and sp.logprobs is None
        # Sampled with the request's keys and nothing that needs the host between tokens:
        # the draw is an MLX op too, computed with the logits.
        self.keyed = (self.sampler is not greedy_sampler and not self.processors and sp.logprobs is None
                      and grammar is None)
        self.queued: list[int] = []  # tokens the grammar forces after the last decided one, not yet taken
        self.ended = False

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (drafts then verify by equality)."""
        return self.sampler is greedy_sampler

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, not yet taken ([] without a grammar)."""
        if not self.queued and self.grammar is not None:
            self.queued = self.grammar.forced()
        return self.queued

    def choice(self, logits: mx.array) -> mx.array | None:
        """The next token as an array computed from the (not yet evaluated) logits, to
        be evaluated with them, where it needs nothing else: plain greedy (the argmax,
        of the masked logits with a grammar: the mask depends on the tokens before only)
        and no forced token, or a keyed draw with nothing to adjust or report (it takes
        the sampler's next key now); None otherwise (`accept` computes it)."""
        if self.keyed:
            return self.sampler((logits - mx.logsumexp(logits, keepdims=True))[None])[0]
        if not self.plain or self.forced():
            return None
        return mx.argmax(self.grammar.mask(logits) if self.grammar is not None else logits)

    @property
    def host_free(self) -> bool:
        """Whether `choice` decides every next token without the host: the token after
        it can be fed before this one is taken (no grammar, no processors)."""
        return (self.plain or self.keyed) and self.grammar is None

    def accept(self, logits: mx.array, chosen: mx.array | None = None) -> tuple[int, Chunk]:
        """Sample from the logits after the last fed token (`chosen`: this decoder's
        `choice` for them, evaluated; or take the token the grammar forces there): the
        token and its chunk."""
        if self.forced():
            pick = self.take_forced(1)[0]
        elif chosen is not None:
            pick = self._decided(Pick(int(chosen.item())))
        else:
            pick = self._sample(logits)
        return pick.token, self.emit(pick)

    def _sample(self, logits: mx.array) -> Pick:
        """The token drawn from `logits` (penalties, the grammar's mask, the sampler)."""
        for proc in self.processors:
            logits = proc(self.context, logits[None])[0]
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        if self.plain:
            return self._decided(Pick(int(mx.argmax(logits).item())))
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return self._decided(Pick(int(self.sampler(logprobs[None]).item()), logprobs))

    def _decided(self, pick: Pick) -> Pick:
        """`pick`, seen by the penalties' context and taken by the grammar (if any):
        whether it ended there."""
        if self.processors:
            self.context = mx.concatenate([self.context, mx.array([pick.token])])
        if self.grammar is not None:
            self.grammar.consume(pick.token)
            pick.ends = self.grammar.done
        return pick

    def take_forced(self, n: int) -> list[Pick]:
        """The next `n` forced tokens, decided: each counted, and each advancing a
        sampler's position as its draw would have."""
        taken, self.queued = self.queued[:n], self.queued[n:]
        self.stats.forced_tokens += len(taken)
        if not self.greedy:
            self.rng["step"] += len(taken)
        return [self._decided(Pick(t, forced=True)) for t in taken]

    def guessable(self, draft: list[int]) -> list[int]:
        """Of drafted `draft`, the part a verify may check (all of it without a grammar)."""
        return draft if self.grammar is None else draft[:self.grammar.guessable(draft)]

    def emit(self, pick: Pick) -> Chunk:
        """The chunk for a decided token; at end-of-sequence, the grammar's end, a stop
        string or the token limit it is the last (`ended`)."""
        token = pick.token
        if self.grammar is not None and token in self.grammar.ends and not self.sp.ignore_eos:
            self.reply.reason = "stop"  # an end token the grammar allowed: never counted or shown
            return self.end("")
        text = self.reply.add(token)
        if text is None:  # end-of-sequence: never counted or shown
            return self.end("")
        if pick.ends:  # the grammar is satisfied and takes nothing more
            self.reply.reason = "stop"
        logprob, top = self._logprobs(pick)
        if self.reply.reason:
            return self.end(text, token, logprob, top)
        return Chunk(text, token, logprob=logprob, top_logprobs=top)

    def _logprobs(self, pick: Pick) -> tuple[float | None, list | None]:
        """The token's log-probability and the top alternatives, when asked (a forced
        token's: 0, alone)."""
        if self.sp.logprobs is None:
            return None, None
        if pick.forced:
            return 0.0, [(pick.token, 0.0)] if self.sp.logprobs else []
        return token_logprobs(pick.token, pick.logprobs, self.sp.logprobs)

    def end(self, text: str, token: int | None = None, logprob=None, top=None) -> Chunk:
        """The reply's last chunk (the text held back until now added); its stats are
        the sequence's to attach."""
        tail = self.reply.end()
        self.ended = True
        return Chunk(text + tail, token, finish_reason=self.reply.reason, logprob=logprob, top_logprobs=top)

    def verify(self, draft: list[int], logits: mx.array, certain: int = 0) -> tuple[int, list[Pick]]:
        """Of `draft`, fed after the pending token ([k+1, vocab] logits), whose first
        `certain` tokens the grammar forced: how many stand (the forced ones, then the
        drafted ones the model agrees with: greedy, its argmax; sampled, the
        speculative-sampling rule, one token at a time), and the decided tokens of the
        step in order (those, then the token after them)."""
        picks = self.take_forced(certain)
        guess, rows = draft[certain:], logits[certain:]
        if not guess:  # the row after the forced tokens: the next forced one, or a draw
            return certain, picks + [self.take_forced(1)[0] if self.forced() else self._sample(rows[0])]
        forced_after: list[int] = []
        if self.grammar is not None:
            masks = self.grammar.row_masks(guess)
            rows, forced_after = apply_mask(rows, masks.bias), masks.forced_after
        if self.greedy:
            accepted, nxt = greedy_accept(rows, guess)
            lp = None if self.sp.logprobs is None else rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        else:
            lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            accepted, nxt = sampled_accept(sampling_logprobs(self.sp, lp), guess, self.rng)
        picks += [self._decided(Pick(t, None if lp is None else lp[i])) for i, t in enumerate(guess[:accepted])]
        if accepted == len(guess) and forced_after:  # plain decoding takes the forced token there
            self.queued = forced_after
            if not self.greedy:
                self.rng["step"] -= 1  # sampled_accept drew it; a forced token advances the position once
            return certain + accepted, picks + self.take_forced(1)
        return certain + accepted, picks + [self._decided(Pick(nxt, None if lp is None else lp[accepted]))]

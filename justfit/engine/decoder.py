"""What turns a sequence's logits into its reply: the request's sampler and logits
processors, its stop text (justfit.engine.stops.ReplyText) and log-probabilities. A
`Decoder` is built once the prompt is in (`accept` takes the first token's logits);
a constraint on the output (a grammar) would plug in here, as one more step between
the logits and the sampled token."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from justfit.config import SamplingParams
from justfit.engine.generate import token_logprobs
from justfit.engine.sampling import keyed_sampler, logits_processors, sampling_logprobs
from justfit.engine.speculate import greedy_accept, sampled_accept
from justfit.engine.stats import Chunk, GenerationStats
from justfit.engine.stops import ReplyText


class Decoder:
    """Sampling and stop text for one reply: `accept(logits)` samples a token and
    returns its chunk; `finish_reason` on a chunk says the reply ended there."""

    def __init__(self, tokenizer, sp: SamplingParams, stats: GenerationStats, prompt: list[int], vocab: int,
                 rng: dict):
        self.sp, self.rng = sp, rng
        self.reply = ReplyText(tokenizer, sp, stats)
        self.sampler = keyed_sampler(sp, vocab, rng)
        self.processors = logits_processors(sp, len(prompt))
        self.context = mx.array(prompt)  # what the processors see: prompt and reply so far
        # Greedy with nothing to adjust or report: the argmax of the logits is the token
        # (the normalizing logsumexp over the vocabulary is a cost every token on the CPU).
        self.plain = self.sampler is greedy_sampler and not self.processors and sp.logprobs is None
        self.ended = False

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (drafts then verify by equality)."""
        return self.sampler is greedy_sampler

    def accept(self, logits: mx.array) -> tuple[int, Chunk]:
        """Sample from the logits after the last fed token: the token and its chunk."""
        if self.plain:
            token, logprobs = int(mx.argmax(logits).item()), None
        else:
            for proc in self.processors:
                logits = proc(self.context, logits[None])[0]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = int(self.sampler(logprobs[None]).item())
            if self.processors:
                self.context = mx.concatenate([self.context, mx.array([token])])
        return token, self.emit(token, logprobs)

    def emit(self, token: int, logprobs: mx.array | None) -> Chunk:
        """The chunk for a sampled `token` (drawn from `logprobs`, when known); at
        end-of-sequence, a stop string or the token limit it is the last (`ended`)."""
        text = self.reply.add(token)
        if text is None:  # end-of-sequence: never counted or shown
            return self.end("")
        logprob, top = (token_logprobs(token, logprobs, self.sp.logprobs) if self.sp.logprobs is not None
                        else (None, None))
        if self.reply.reason:
            return self.end(text, token, logprob, top)
        return Chunk(text, token, logprob=logprob, top_logprobs=top)

    def end(self, text: str, token: int | None = None, logprob=None, top=None) -> Chunk:
        """The reply's last chunk (the text held back until now added); its stats are
        the sequence's to attach."""
        tail = self.reply.end()
        self.ended = True
        return Chunk(text + tail, token, finish_reason=self.reply.reason, logprob=logprob, top_logprobs=top)

    def verify(self, draft: list[int], logits: mx.array) -> tuple[int, int, mx.array | None]:
        """Of `draft`, fed after the pending token ([k+1, vocab] logits): how many the
        model agrees with (greedy: its argmax; sampled: the speculative-sampling rule,
        the distribution of one token at a time), the token after them, and the rows'
        log-probabilities when they are reported."""
        if self.greedy:
            accepted, nxt = greedy_accept(logits, draft)
            rows = None if self.sp.logprobs is None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return accepted, nxt, rows
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        accepted, nxt = sampled_accept(sampling_logprobs(self.sp, rows), draft, self.rng)
        return accepted, nxt, rows

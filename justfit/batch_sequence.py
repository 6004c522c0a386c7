"""One request inside a batch: its plan, cache and tokens, prefilled chunk by chunk,
then fed one sampled token per batched decode step (justfit.batch). What
justfit.runner does for a lone request, cut at the points where the batch interleaves
sequences: between prefill chunks and between decode steps."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import mlx.core as mx

import kvexec
from justfit import pages
from justfit.config import SamplingParams
from justfit.generate import feed, prefill, token_logprobs
from justfit.sampling import keyed_sampler, logits_processors, new_rng
from justfit.stats import Chunk, GenerationStats
from justfit.stops import ReplyText
from statetrans import Parked, holds, keep_parked, park, unpark

if TYPE_CHECKING:
    from justfit.engine import Engine


class Sequence:
    """A request's state between steps: `remaining` prompt tokens to prefill, then a
    `pending` token to feed; `finished` once its reply ends."""

    def __init__(self, engine: Engine, tokens: list[int], sampling: SamplingParams, session: str | None = None,
                 scope: str = ""):
        if not tokens:
            raise ValueError("empty prompt")
        self.engine, self.tokens, self.sp, self.session = engine, list(tokens), sampling, session
        self.scope = scope  # whose stored states it may reuse and write
        self.base: int | None = None  # the session's generation it started from (lost updates are forks)
        # The planner's footprint for this sequence alone; refuses, before any work, what cannot fit.
        self.offloaded, self.plan = engine.check_fits(len(tokens), sampling.max_tokens)
        self.stats = GenerationStats(prompt_tokens=len(tokens), planned_bytes=self.plan.total,
                                     prefill_chunk=self.plan.shape.chunk)
        self.cache: list | None = None
        self.reader = None  # reads the cache's pages on disk (justfit.pages)
        self.held: list[int] = []  # exactly what `cache` holds
        self.pending: int | None = None  # sampled, not yet fed
        self.finished = False
        self._decode_started = 0.0
        self.parked: Parked | None = None  # set aside on disk (justfit.batch preempted it)
        self._parked_at = 0.0
        self.admitted = 0  # the batch's admission number: the latest admitted is parked first

    def start(self, state_allowance: int | None) -> None:
        """Take the stored state sharing the longest prefix (the memory tier held to
        `state_allowance`), bound its pages to its plan, and pin its prompt."""
        e = self.engine
        reuse = e.states.take(self.tokens, self.session, state_allowance, scope=self.scope)
        self.base = reuse.base
        self._bind(reuse.cache if reuse.cache is not None else e.new_cache())
        kvexec.keep_exact(self.cache, len(self.tokens) - 1)  # as justfit.runner does: the same prompt again computes this reply
        self.held = list(reuse.tokens)
        s = self.stats
        s.cached_tokens, s.restored_from, s.restore_s = len(self.held), reuse.source, reuse.seconds
        self.rng = new_rng(self.sp.seed) if self.sp.seed is not None else (reuse.sampler or new_rng())

    def _bind(self, cache: list) -> None:
        """Use `cache`, its pages held to this sequence's plan and its prompt pinned."""
        e, plan = self.engine, self.plan
        # Each sequence's pages keep to its own plan: the batch was admitted on the sum
        # of the plans (justfit.batch.BatchRunner.fits).
        room = None if e.config.budget_bytes is None else plan.page_allowance(plan.total)
        pages.release(self.cache, self.reader)
        self.reader = pages.bind(e, cache, plan, room, len(self.tokens))
        self.cache = cache

    def park(self) -> float:
        """Set this sequence aside: its exact state written to disk through StateTrans,
        its cache let go (what it sampled, its stops and text stay here); the seconds
        the write took. Raises, with the cache kept, when the write fails."""
        started = time.perf_counter()  # the time set aside counts the write too
        self.parked = park(self.engine.states, self.held, self.cache, self.rng, self.scope)
        pages.release(self.cache, self.reader)
        self.cache = self.reader = None
        self._parked_at = started
        s = self.stats
        s.preemptions += 1
        s.swap_s += self.parked.write_s
        return self.parked.write_s

    def resume(self) -> float:
        """Take the parked state back, byte for byte, and go on where it stopped; the
        seconds the read took."""
        cache, read_s = unpark(self.engine.states, self.parked)
        self.parked = None
        self._bind(cache)
        s = self.stats
        away = time.perf_counter() - self._parked_at
        s.swap_s += read_s
        s.preempted_s += away
        if self._decode_started:  # decode time counts the steps taken, not the time set aside
            self._decode_started += away
        return read_s

    @property
    def remaining(self) -> int:
        """Prompt tokens not yet in the cache (0 once decoding or finished)."""
        if self.cache is None or self.pending is not None or self.finished:
            return 0
        return len(self.tokens) - len(self.held)

    def prefill(self, limit: int | None = None) -> Chunk | None:
        """Feed the next chunk of the prompt (the planned chunk, or `limit` tokens if
        fewer); after the last one, the first token's chunk."""
        e, done = self.engine, len(self.held)
        size = self.plan.shape.chunk if limit is None else max(1, min(limit, self.plan.shape.chunk))
        if self.engine.config.deterministic:  # as justfit.generate.prefill: pages seen do not depend on it
            size = kvexec.chunk_room(self.cache, size)
        piece = self.tokens[done:done + size]
        last = done + len(piece) == len(self.tokens)
        with e.swap.phase("prefill", dense=self.plan.shape.dense_prefill) as phase:
            if last:  # the head runs on the prompt's last position only, as the planner counts
                logits = prefill(e.model, piece, self.cache, chunk=len(piece))
            else:
                feed(e.model, piece, self.cache)
        self.held.extend(piece)
        self.stats.prefill_s += phase.seconds
        return self._first(logits) if last else None

    def _first(self, logits: mx.array) -> Chunk:
        """Set up sampling once the prompt is in; the first token's chunk."""
        sp = self.sp
        self.reply = ReplyText(self.engine.tokenizer, sp, self.stats)
        if sp.max_tokens == 0:
            return self._end("")
        self.sampler = keyed_sampler(sp, int(logits.shape[-1]), self.rng)
        self.processors = logits_processors(sp, len(self.tokens))
        self.context = mx.array(self.tokens)
        self._decode_started = time.perf_counter()
        return self.accept(logits)

    def accept(self, logits: mx.array) -> Chunk:
        """Sample from the logits after the last fed token; the chunk to send (the
        last one, with stats, when the reply ends)."""
        sp, s = self.sp, self.stats
        for proc in self.processors:
            logits = proc(self.context, logits[None])[0]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = int(self.sampler(logprobs[None]).item())
        self.context = mx.concatenate([self.context, mx.array([token])])
        s.decode_s = time.perf_counter() - self._decode_started
        text = self.reply.add(token)
        if text is None:  # end-of-sequence
            return self._end("")
        logprob, top = token_logprobs(token, logprobs, sp.logprobs) if sp.logprobs is not None else (None, None)
        if self.reply.reason:
            return self._end(text, token, logprob, top)
        self.pending = token
        return Chunk(text, token, logprob=logprob, top_logprobs=top)

    def fed(self) -> None:
        """The pending token went through a decode step: the cache holds it."""
        self.held.append(self.pending)
        self.pending = None

    def _end(self, text: str, token: int | None = None, logprob=None, top=None) -> Chunk:
        tail = self.reply.end()
        self.finished = True
        s = self.stats
        s.decode_s = time.perf_counter() - self._decode_started if self._decode_started else 0.0
        return Chunk(text + tail, token, finish_reason=s.finish_reason, stats=s, logprob=logprob, top_logprobs=top)

    def store(self) -> None:
        """Keep what was computed (also on cancel or error) as a stored state, unless an
        interrupted step left the cache and the tokens apart; then let the cache go."""
        cache, self.cache = self.cache, None
        self.stats.kv_disk = pages.disk_stats(cache, self.reader)
        pages.release(cache, self.reader)
        self.reader = None
        if self.parked is not None:  # ended while set aside: its snapshot becomes a stored state
            keep_parked(self.engine.states, self.parked)
            self.parked = None
            return
        if cache is None:
            return
        if self.held and holds(cache, len(self.held)):
            stored = self.engine.states.put(self.held, cache, self.session, self.rng, scope=self.scope,
                                            base=self.base)
            self.stats.state_write = stored.write if self.session else None
        self.stats.kv_formats = kvexec.page_formats(cache)

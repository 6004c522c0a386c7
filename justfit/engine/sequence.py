"""One request from admission to its stored state: its plan, cache and tokens,
prefilled chunk by chunk, then decoded one step at a time (a step feeds the sampled
token, and with drafting on the tokens drafted after it: justfit.engine.draft). Every
request is a `Sequence`; a lone one runs as a batch of one (justfit.engine.batch), so what
is written here is written once: the seed, the pinned prompt, the sampling step, the
exact rollback of rejected drafts, and storing the state only if the cache holds it."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

import kvexec
from justfit.engine import pages
from justfit.config import SamplingParams
from justfit.engine.draft import NgramDrafter
from justfit.engine.generate import feed, prefill, token_logprobs
from justfit.memory import MemoryReport, memory_report
from justfit.engine.sampling import keyed_sampler, logits_processors, new_rng, sampling_logprobs
from justfit.engine.speculate import TokenAcceptance, draft_length, greedy_accept, sampled_accept
from justfit.engine.stats import Chunk, GenerationStats
from justfit.engine.stops import ReplyText
from phaseswap import PhaseStats
from statetrans import Parked, holds, keep_parked, park, unpark



PROBE_AFTER = 64  # drafts declined in a row before a short one is verified anyway


class Sequence:
    """A request's state between steps: `remaining` prompt tokens to prefill, then a
    `pending` token to feed; `finished` once its reply ends."""

    def __init__(self, engine, tokens: list[int], sampling: SamplingParams, session: str | None = None,
                 scope: str = "", drafter: Callable[[list[int]], NgramDrafter] | None = None):
        if not tokens:
            raise ValueError("empty prompt")
        self.engine, self.tokens, self.sp, self.session = engine, list(tokens), sampling, session
        self.scope = scope  # whose stored states it may reuse and write
        self.base: int | None = None  # the session's generation it started from (lost updates are forks)
        # The planner's footprint for this sequence alone; refuses, before any work, what cannot fit.
        self.offloaded, self.plan = engine.planner.check_fits(len(tokens), sampling.max_tokens)
        self.stats = GenerationStats(prompt_tokens=len(tokens), planned_bytes=self.plan.total,
                                     prefill_chunk=self.plan.shape.chunk)
        self.cache: list | None = None
        self.reader = None  # reads the cache's pages on disk (justfit.engine.pages)
        self.held: list[int] = []  # exactly what `cache` holds
        self.pending: int | None = None  # sampled, not yet fed
        self.finished = False
        self._decode_started = 0.0
        self.parked: Parked | None = None  # set aside on disk (justfit.engine.batch preempted it)
        self._parked_at = 0.0
        self.admitted = 0  # the batch's admission number: the latest admitted is parked first
        # From the prompt: what drafts tokens to verify (justfit.engine.draft's interface); by
        # default the n-gram drafter proposing all it has, `draft` weighing the length.
        self._new_drafter = drafter or (lambda tokens: NgramDrafter(tokens, adapt_length=False))
        self.drafter: NgramDrafter | None = None  # once decoding, when drafting is on
        self.acceptance = TokenAcceptance()  # how likely its drafted tokens are accepted
        self._declined = 0  # drafts proposed and not verified since the last verify

    def start(self, state_allowance: int | None) -> None:
        """Take the stored state sharing the longest prefix (the memory tier held to
        `state_allowance`), bound its pages to its plan, and pin its prompt."""
        e = self.engine
        reuse = e.states.take(self.tokens, self.session, state_allowance, scope=self.scope)
        self.base = reuse.base
        self._bind(reuse.cache if reuse.cache is not None else e.new_cache())
        # The same prompt again resumes from here (all but the last token): trimmed back
        # exactly, it computes the reply this request computes.
        kvexec.keep_exact(self.cache, len(self.tokens) - 1)
        self.held = list(reuse.tokens)
        s = self.stats
        s.cached_tokens, s.restored_from, s.restore_s = len(self.held), reuse.source, reuse.seconds
        self.rng = new_rng(self.sp.seed) if self.sp.seed is not None else (reuse.sampler or new_rng())

    def _bind(self, cache: list) -> None:
        """Use `cache`, its pages held to this sequence's plan and its prompt pinned."""
        e, plan = self.engine, self.plan
        # Each sequence's pages keep to its own plan: the batch was admitted on the sum
        # of the plans (justfit.engine.batch.BatchRunner.fits).
        room = None if e.budget.bytes is None else plan.page_allowance(plan.total)
        pages.release(self.cache, self.reader)
        self.reader = pages.bind(e.config, cache, plan, room, len(self.tokens), e.numerics.deterministic)
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

    def note_phase(self, phase: PhaseStats) -> None:
        """Add a step's phase to the stats: one entry per run of steps of one phase."""
        phases = self.stats.phases
        if not phases or phases[-1].name != phase.name:
            phases.append(PhaseStats(name=phase.name))
        total = phases[-1]
        for name in ("seconds", "materialized_bytes", "released_bytes", "disk_read_bytes", "disk_loads"):
            setattr(total, name, getattr(total, name) + getattr(phase, name))
        total.peak_bytes = max(total.peak_bytes, phase.peak_bytes)
        total.resident_components, total.offloaded_components = phase.resident_components, phase.offloaded_components

    # -- prefill ---------------------------------------------------------------
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
        if self.engine.numerics.deterministic:  # the pages a position sees do not depend on the chunk
            size = kvexec.chunk_room(self.cache, size)
        piece = self.tokens[done:done + size]
        last = done + len(piece) == len(self.tokens)
        with e.swap.phase("prefill", dense=self.plan.shape.dense_prefill) as phase:
            if last:  # the head runs on the prompt's last position only, as the planner counts
                logits = prefill(e.model, piece, self.cache, chunk=len(piece))
            else:
                feed(e.model, piece, self.cache)
        self.note_phase(phase)
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
        if self._may_draft():
            self.drafter = self._new_drafter(self.tokens)
        self._decode_started = time.perf_counter()
        return self.accept(logits)

    def _may_draft(self) -> bool:
        """Drafting is on for this sequence: the engine drafts, the request allows it,
        nothing rewrites logits from the context (penalties), a seeded sampled request
        keeps its one reply (whether a step verified a draft depends on timing and the
        batch, and changes which draws a sampled reply takes; a greedy reply does not
        change where the numerics are row-invariant: justfit.engine.numerics), every layer can
        drop rejected positions exactly, and a forward may compute several rows."""
        return (self.engine.config.draft == "ngram" and self.sp.speculate and not self.processors
                and not self.engine.numerics.one_row
                and (self.sp.temperature == 0 or self.sp.seed is None)
                and all(isinstance(c, kvexec.PagedKVCache) for c in self.cache))

    @property
    def _plain(self) -> bool:
        """Greedy with nothing to adjust or report: the argmax of the logits is the token
        (the normalizing logsumexp over the vocabulary is a cost every token on the CPU)."""
        return self.sampler is greedy_sampler and not self.processors and self.sp.logprobs is None

    # -- decode ----------------------------------------------------------------
    def accept(self, logits: mx.array) -> Chunk:
        """Sample from the logits after the last fed token; the chunk to send (the
        last one, with stats, when the reply ends)."""
        if self._plain:
            token, logprobs = int(mx.argmax(logits).item()), None
        else:
            for proc in self.processors:
                logits = proc(self.context, logits[None])[0]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = int(self.sampler(logprobs[None]).item())
            if self.processors:
                self.context = mx.concatenate([self.context, mx.array([token])])
        chunk = self._emit(token, logprobs)
        if not self.finished:
            self.pending = token
        return chunk

    def _emit(self, token: int, logprobs: mx.array | None) -> Chunk:
        """The chunk for a sampled `token` (drawn from `logprobs`, when known); ends the
        reply at end-of-sequence, a stop string or the token limit."""
        self.stats.decode_s = time.perf_counter() - self._decode_started
        if self.drafter is not None:
            self.drafter.extend([token])
        text = self.reply.add(token)
        if text is None:  # end-of-sequence
            return self._end("")
        logprob, top = (token_logprobs(token, logprobs, self.sp.logprobs) if self.sp.logprobs is not None
                        else (None, None))
        if self.reply.reason:
            return self._end(text, token, logprob, top)
        return Chunk(text, token, logprob=logprob, top_logprobs=top)

    def fed(self) -> None:
        """The pending token went through a decode step: the cache holds it."""
        self.held.append(self.pending)
        self.pending = None

    def draft(self) -> list[int]:
        """Tokens drafted to follow the pending one, to verify in the same step ([]: a
        plain step). A draft never reaches a page flush, so rejected positions are
        dropped exactly (kvexec.chunk_room), nor past the reply's token limit or the
        rows the plan counted for a decode step."""
        d = self.drafter
        if d is None or not d.active or self.pending is None:
            return []
        rows = min(1 + d.max_draft, self.plan.shape.verify_rows)  # the plan may leave no room for drafts
        room = kvexec.chunk_room(self.cache, rows) - 1
        limit = min(room, self.sp.max_tokens - self.stats.generated_tokens)
        proposal = d.propose(limit) if limit > 0 else []
        k = draft_length(len(proposal), self.acceptance.rate, self.engine.step_costs)
        if proposal and not k:
            # Declined while a step of more rows costs more than the tokens it is likely to
            # add; now and then a short one measures the acceptance again.
            self._declined += 1
            if self._declined >= PROBE_AFTER and self.engine.step_costs.cost(1) is not None:
                k = min(len(proposal), 2)
        if k:
            self._declined = 0
        return proposal[:k]

    def verify(self, draft: list[int], logits: mx.array) -> list[Chunk]:
        """Take the logits after feeding the pending token and `draft` ([k+1, vocab]):
        keep the drafted tokens the model agrees with (greedy: its argmax; sampled: the
        speculative-sampling rule, the same distribution as one token at a time),
        drop the rest from the cache exactly, and return a chunk per token the step
        produced (the accepted drafts, then the model's own next one)."""
        k = len(draft)
        if self.sampler is greedy_sampler:
            accepted, nxt = greedy_accept(logits, draft)
            rows = None if self.sp.logprobs is None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        else:
            rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            accepted, nxt = sampled_accept(sampling_logprobs(self.sp, rows), draft, self.rng)
        self.stats.drafted_tokens += k
        self.stats.accepted_tokens += accepted
        self.drafter.feedback(k, accepted)
        self.acceptance.add(k, accepted)
        self._drop(k - accepted)
        self.held.append(self.pending)
        self.pending = None
        chunks = []
        for i, token in enumerate(draft[:accepted] + [nxt]):
            chunks.append(self._emit(token, None if rows is None else rows[i]))
            if self.finished:  # the reply ended at a drafted token: it, and what follows, leave the cache
                self._drop(accepted - i)
                return chunks
            if i < accepted:
                self.held.append(token)
        self.pending = nxt
        return chunks

    def _drop(self, n: int) -> None:
        """Remove the last `n` positions from the cache (a rejected or unneeded draft)."""
        if n > 0 and not kvexec.trim(self.cache, n):
            raise RuntimeError(f"could not drop {n} drafted positions from the cache")

    def _end(self, text: str, token: int | None = None, logprob=None, top=None) -> Chunk:
        tail = self.reply.end()
        self.finished = True
        s = self.stats
        s.decode_s = time.perf_counter() - self._decode_started if self._decode_started else 0.0
        s.memory = self.memory()
        s.kv_disk = pages.disk_stats(self.cache, self.reader)
        return Chunk(text + tail, token, finish_reason=s.finish_reason, stats=s, logprob=logprob, top_logprobs=top)

    def memory(self) -> MemoryReport:
        """Memory now: resident weights, this sequence's KV, the peak of its phases, the
        stored states besides its own."""
        peak = max([p.peak_bytes for p in self.stats.phases] + [mx.get_peak_memory()])
        states = self.engine.states
        own = states.last.nbytes if states.last and self.cache is not None and states.last.cache is self.cache else 0
        return memory_report(self.engine.swap.registry.resident_bytes(), self.cache, peak, states.memory_bytes - own)

    def store(self) -> None:
        """Keep what was computed (also on cancel or error) as a stored state, unless an
        interrupted step left the cache and the tokens apart; then let the cache go."""
        cache, self.cache = self.cache, None
        if self.stats.kv_disk is None:
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

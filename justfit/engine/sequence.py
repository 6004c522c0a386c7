"""One request from admission to its stored state: its plan (the scheduler's, from the
planner), cache and tokens, prefilled chunk by chunk, then decoded one step at a time (a
step feeds the sampled token, and with drafting on the tokens drafted after it:
justfit.engine.drafting). Every request is a `Sequence` on the scheduler's step loop
(justfit.engine.scheduler), so what is written here is written once: the seed, the
pinned prompt, the exact rollback of rejected drafts, and storing the state only if the
cache holds it. Sampling and stop text are its decoder's (justfit.engine.decoder); where
its state comes from and goes, its state source's (justfit.engine.state_source)."""

from __future__ import annotations

import enum
import time

import mlx.core as mx

import kvexec
from justfit.config import SamplingParams
from justfit.engine import pages
from justfit.engine.decoder import Decoder
from justfit.engine.drafting import DraftPolicy, DrafterFactory, ngram_drafter
from justfit.engine.generate import feed, prefill
from justfit.engine.sampling import new_rng
from justfit.engine.state_source import StateSource
from justfit.engine.stats import Chunk, GenerationStats
from justfit.memory import MemoryReport, memory_report
from justfit.planning.cost_model import Footprint
from phaseswap import PhaseStats
from statetrans import Parked, holds, keep_parked, park, unpark


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # planned, not started
    PREFILLING = "prefilling"  # prompt tokens left to feed
    DECODING = "decoding"  # a sampled token pending
    PARKED = "parked"  # set aside on disk (preempted)
    FINISHED = "finished"  # its reply ended


class Sequence:
    """A request's state between steps: `remaining` prompt tokens to prefill, then a
    `pending` token to feed; FINISHED once its reply ends."""

    def __init__(self, engine, tokens: list[int], sampling: SamplingParams,
                 offloaded: tuple[str, ...], plan: Footprint, source: StateSource, session: str | None = None,
                 scope: str = "", drafter: DrafterFactory | None = None):
        if not tokens:
            raise ValueError("empty prompt")
        self.engine, self.tokens, self.sp, self.session = engine, list(tokens), sampling, session
        self.scope = scope  # whose stored states it may reuse and write
        self.offloaded, self.plan, self.source = offloaded, plan, source  # the planner's, for this sequence alone
        self.status = Status.WAITING
        self.base = 0  # the session's generation it started from (lost updates are forks)
        self.stats = GenerationStats(prompt_tokens=len(tokens), planned_bytes=plan.total,
                                     prefill_chunk=plan.shape.chunk)
        self.cache: list | None = None
        self.reader = None  # reads the cache's pages on disk (justfit.engine.pages)
        self.held: list[int] = []  # exactly what `cache` holds
        self.pending: int | None = None  # sampled, not yet fed
        self.rng: dict = {}  # the sampler's position, once started
        self.decoder: Decoder | None = None  # once the prompt is in
        self.drafts: DraftPolicy | None = None  # once decoding, when drafting is on
        self.certain = 0  # of the last draft, the leading tokens the grammar forced (always accepted)
        self._new_drafter = drafter or ngram_drafter
        self._decode_started = 0.0
        self.parked: Parked | None = None  # the snapshot while set aside on disk
        self._parked_at = 0.0
        self.admitted = 0  # the scheduler's admission number: the latest admitted is parked first
        self.pipeline = None  # the batch's Pipeline while a step is dispatched ahead with this sequence in it

    @property
    def finished(self) -> bool:
        """Whether its reply ended."""
        return self.status is Status.FINISHED

    @property
    def drafter(self) -> object | None:
        """What drafts its tokens, when drafting is on."""
        return self.drafts.drafter if self.drafts is not None else None

    def start(self, state_allowance: int | None) -> None:
        """Take the stored state sharing the longest prefix (the memory tier held to
        `state_allowance`), bound its pages to its plan, and pin its prompt."""
        reuse = self.source.take(self.tokens, self.session, state_allowance, self.scope)
        self.base = reuse.base
        self._bind(reuse.cache if reuse.cache is not None else self.engine.new_cache())
        # The same prompt again resumes from here (all but the last token): trimmed back
        # exactly, it computes the reply this request computes.
        kvexec.keep_exact(self.cache, len(self.tokens) - 1)
        self.held = list(reuse.tokens)
        s = self.stats
        s.cached_tokens, s.restored_from, s.restore_s = len(self.held), reuse.source, reuse.seconds
        self.rng = new_rng(self.sp.seed) if self.sp.seed is not None else (reuse.sampler or new_rng())
        self.status = Status.PREFILLING

    def _bind(self, cache: list) -> None:
        """Use `cache`, its pages held to the room its source gives and its prompt pinned."""
        e = self.engine
        room = self.source.page_room(self.plan, e.budget.bytes)
        pages.release(self.cache, self.reader)
        self.reader = pages.bind(e.config, cache, self.plan, room, len(self.tokens), e.numerics.deterministic)
        self.cache = cache

    def park(self) -> float:
        """Set this sequence aside: its exact state written to disk through StateTrans,
        its cache let go (what it sampled, its stops and text stay here); the seconds
        the write took. Raises, with the cache kept, when the write fails."""
        if self.pipeline is not None:  # a step dispatched ahead is undone first: the state is what was taken
            self.pipeline.settle()
        started = time.perf_counter()  # the time set aside counts the write too
        self.parked = park(self.engine.states, self.held, self.cache, self.rng, self.scope)
        pages.release(self.cache, self.reader)
        self.cache = self.reader = None
        self._parked_at = started
        self.status = Status.PARKED
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
        self.status = Status.DECODING if self.pending is not None else Status.PREFILLING
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
        """Prompt tokens not yet in the cache (0 unless prefilling)."""
        return len(self.tokens) - len(self.held) if self.status is Status.PREFILLING else 0

    def prefill(self, limit: int | None = None) -> Chunk | None:
        """Feed the next chunk of the prompt (the planned chunk, or `limit` tokens if
        fewer); after the last one, the first token's chunk."""
        e, done = self.engine, len(self.held)
        size = self.plan.shape.chunk if limit is None else max(1, min(limit, self.plan.shape.chunk))
        if e.numerics.deterministic:  # the pages a position sees do not depend on the chunk
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
        constraint = self.sp.constraint
        grammar = self.engine.grammars.matcher(constraint) if constraint is not None else None
        self.decoder = Decoder(self.engine.tokenizer, self.sp, self.stats, self.tokens, int(logits.shape[-1]),
                               self.rng, grammar)
        self.status = Status.DECODING
        if self.sp.max_tokens == 0:
            return self._end(self.decoder.end(""))
        if self._may_draft():
            self.drafts = DraftPolicy(self._new_drafter(self.tokens), self.engine.step_costs)
        self._decode_started = time.perf_counter()
        return self.accept(logits)

    def _may_draft(self) -> bool:
        """Drafting is on for this sequence: the engine drafts, the request allows it,
        nothing rewrites logits from the context (penalties), a seeded sampled request
        keeps its one reply (whether a step verified a draft depends on timing and the
        batch, and changes which draws a sampled reply takes; a greedy reply does not
        change where the numerics are row-invariant: justfit.engine.numerics), every layer can
        drop rejected positions exactly, and a forward may compute several rows."""
        return (self.engine.config.draft == "ngram" and self.sp.speculate and not self.decoder.processors
                and (self.sp.temperature == 0 or self.sp.seed is None) and self._rows_droppable())

    def _rows_droppable(self) -> bool:
        """A forward may feed several rows and the cache drop the last ones exactly: not
        one row per forward (justfit.engine.numerics), every layer paged."""
        return not self.engine.numerics.one_row and all(isinstance(c, kvexec.PagedKVCache) for c in self.cache)

    def _may_force(self) -> bool:
        """Forced tokens ride in the next step's forward: the request has a grammar and
        allows it, and the forward may feed several rows (else one a step)."""
        return self.decoder.grammar is not None and self.sp.force_tokens and self._rows_droppable()

    # -- decode ----------------------------------------------------------------
    def accept(self, logits: mx.array, chosen: mx.array | None = None) -> Chunk:
        """Sample from the logits after the last fed token (`chosen`: the token its
        decoder's `choice` computed with them); the chunk to send (the last one, with
        stats, when the reply ends)."""
        token, chunk = self.decoder.accept(logits, chosen)
        chunk = self._emitted(token, chunk)
        if not self.finished:
            self.pending = token
        return chunk

    def _emitted(self, token: int, chunk: Chunk) -> Chunk:
        """`chunk`, sampled as `token`, seen by the drafts and timed; the last one ends the sequence."""
        self.stats.decode_s = time.perf_counter() - self._decode_started
        if self.drafts is not None:
            self.drafts.saw(token)
        return self._end(chunk) if self.decoder.ended else chunk

    def fed(self) -> None:
        """The pending token went through a decode step: the cache holds it."""
        self.held.append(self.pending)
        self.pending = None

    def draft(self, guess: bool = True) -> list[int]:
        """Tokens to feed after the pending one in the same step ([]: a plain step): the
        tokens the grammar forces (`certain` of them, always accepted), else, with
        `guess`, tokens drafted from the sequence's own text that the grammar allows, to
        verify. A draft never reaches a page flush, so rejected positions are dropped
        exactly (kvexec.chunk_room), nor past the reply's token limit or the rows the
        plan counted for a decode step."""
        self.certain = 0
        forcing = self.pending is not None and self._may_force()
        if self.pending is None or (self.drafts is None and not forcing):
            return []
        rows = self.plan.shape.verify_rows  # the plan may leave no room for drafts
        if self.drafts is not None:
            rows = min(1 + self.drafts.max_draft, rows)
        room = min(kvexec.chunk_room(self.cache, rows) - 1, self.sp.max_tokens - self.stats.generated_tokens)
        forced = self.decoder.forced() if forcing else []
        if forced:  # what follows them is the model's next token: no guesses after them
            self.certain = len(forced[:room])
            return forced[:room]
        if not guess or self.drafts is None or self.decoder.forced():
            return []
        return self.decoder.guessable(self.drafts.draft(room))

    def verify(self, draft: list[int], logits: mx.array) -> list[Chunk]:
        """Take the logits after feeding the pending token and `draft` ([k+1, vocab];
        its first `certain` tokens forced): keep the forced tokens and the drafted ones
        the model agrees with, drop the rest from the cache exactly, and return a chunk
        per token the step produced (those, then the model's own next one)."""
        k, certain = len(draft), self.certain
        accepted, picks = self.decoder.verify(draft, logits, certain)
        if k > certain:  # drafted tokens were verified (forced ones are no guess)
            self.stats.drafted_tokens += k - certain
            self.stats.accepted_tokens += accepted - certain
            self.drafts.verified(k - certain, accepted - certain)
        self._drop(k - accepted)
        self.fed()
        chunks = []
        for i, pick in enumerate(picks):
            chunks.append(self._emitted(pick.token, self.decoder.emit(pick)))
            if self.finished:  # the reply ended at a drafted token: it, and what follows, leave the cache
                self._drop(accepted - i)
                return chunks
            if i < accepted:
                self.held.append(pick.token)
        self.pending = picks[-1].token
        return chunks

    def may_feed_ahead(self, alone: bool) -> bool:
        """Whether the step after this one may be built from the token this step decides
        before the host takes it (justfit.engine.batch.Pipeline): its decoder decides
        tokens without the host; no drafts (`alone`: it decodes alone, and would guess);
        this step's token is not the last its token limit allows; and the position the
        next step writes can be dropped exactly (no page flush, no pages on disk) should
        this step's token end the reply."""
        return (self.pending is not None and self.decoder.host_free and self.reader is None
                and (self.drafts is None or not alone)
                and self.stats.generated_tokens + 1 < self.sp.max_tokens and self._rows_droppable()
                and kvexec.chunk_room(self.cache, 2) == 2)

    def take_back(self) -> None:
        """A step fed ahead is not taken: its position leaves the cache and its draw the
        sampler's position, as though it had never been built."""
        self._drop(1)
        if not self.decoder.greedy:
            self.rng["step"] -= 1

    def _drop(self, n: int) -> None:
        """Remove the last `n` positions from the cache (a rejected or unneeded draft)."""
        if n > 0 and not kvexec.trim(self.cache, n):
            raise RuntimeError(f"could not drop {n} drafted positions from the cache")

    def _end(self, chunk: Chunk) -> Chunk:
        """The reply ended with `chunk`: it carries the complete stats."""
        self.status = Status.FINISHED
        self.pending = None
        s = self.stats
        s.decode_s = time.perf_counter() - self._decode_started if self._decode_started else 0.0
        s.memory = self.memory()
        s.kv_disk = pages.disk_stats(self.cache, self.reader)
        chunk.stats = s
        return chunk

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
            self.stats.state_write = self.source.put(self.held, cache, self.session, self.rng, self.scope, self.base)
        self.stats.kv_formats = kvexec.page_formats(cache)

"""The step loop every request runs on: sequences (justfit.engine.sequence) admitted while
their plans fit, prefill chunks interleaved with batched decode steps, drafts verified,
sequences preempted to disk under the budget, and stored when they finish. A lone
request is a batch of one (`run_alone`); the server's worker drives the same runner
(justfit.engine.batch_worker).

Each `BatchRunner.step` feeds every decoding sequence its next token in one forward
pass (the rows share the weights and nothing else: each row attends over its own
pages, kvexec.batch_cache), then runs one prefill chunk of the waiting sequence with
the fewest prompt tokens left (at most `step_tokens` while others decode), so a short
request that arrives during a long prefill gets its first token after at most one of
the long prompt's chunks, and then keeps its pace. Sequences join
and leave between steps. The batch is admitted on its plans: weights once, the sum of
the sequences' KV, the largest transient (`BatchRunner.fits`).
"""

from __future__ import annotations

import logging
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from justfit.planning.plan import measure_request
from justfit.engine.generate import ProgressFn
from justfit.memory import trim_heap
from justfit.engine.sequence import Sequence
from justfit.engine.stats import Chunk
from kvexec.batch_cache import batch_caches
from kvexec.cache import PagedKVCache


log = logging.getLogger("justfit.batch")


def decode_step(model: nn.Module, tokens: list[int], caches: list[list]) -> mx.array:
    """Feed token i to sequence i (its cache list `caches[i]`); the next logits, fp32
    [B, vocab], evaluated with every sequence's new keys and values."""
    if len(tokens) != len(caches) or not tokens:
        raise ValueError(f"{len(tokens)} tokens for {len(caches)} sequences")
    layers = batch_caches(caches) if len(caches) > 1 else caches[0]
    logits = model(mx.array(tokens)[:, None], cache=layers)[:, -1].astype(mx.float32)
    mx.eval(logits, [c.state for c in layers])
    return logits


def verify_step(model: nn.Module, tokens: list[int], cache: list) -> mx.array:
    """Feed `tokens` (the pending token and its draft) to one sequence; the logits
    after each, fp32 [len(tokens), vocab], evaluated with the new keys and values."""
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def batchable(cache: list) -> bool:
    """Whether a sequence's cache can share a batched step (every layer paged; a
    recurrent state cannot be split by row)."""
    return all(isinstance(c, PagedKVCache) for c in cache)


class BatchRunner:
    """The sequences running on `engine`, at most `max_batch` at once.

    With `preempt` (the default) a sequence is counted at what it holds after its next
    step (its whole prompt from the start), not at its plan's end, so more of them fit;
    when the next step would outgrow the budget, the most recently admitted one is
    parked on disk through StateTrans (exact state, pages freed) and resumed, before
    anything new joins, once it fits again: nothing is recomputed. Without it, each
    sequence is counted at its plan's end and nothing is ever parked."""

    def __init__(self, engine, max_batch: int = 4, step_tokens: int = 128, preempt: bool = True):
        if max_batch < 1 or step_tokens < 1:
            raise ValueError("max_batch and step_tokens must be >= 1")
        # While any sequence decodes, a step's prefill chunk is at most step_tokens, so
        # the decoding replies keep their pace during a long prefill.
        self.engine, self.max_batch, self.step_tokens, self.preempt = engine, max_batch, step_tokens, preempt
        self.running: list[Sequence] = []  # in admission order
        self.parked: list[Sequence] = []  # preempted, in admission order: resumed first
        self.steps = 0  # decode steps taken, for stats
        self.preemptions, self.swap_s = 0, 0.0
        self._admitted = 0
        # Under a budget the C heap's free pages go back to the system after each prefill
        # chunk and every 16 decode steps: MLX's many small buffers fragment the heap, and
        # what fragments hold counts against a budget but not in MLX's accounting.
        self._trim = engine.budget.bytes is not None

    def _counted(self, seq: Sequence) -> int:
        """Positions `seq` is counted at (see the class doc)."""
        if not self.preempt:
            return seq.plan.positions
        return min(seq.plan.positions, max(len(seq.tokens), len(seq.held)) + 1)

    def _need(self, seqs: list[Sequence]) -> int:
        """Bytes `seqs` need together: weights and the largest transient once, every
        sequence's KV, the largest reserve."""
        plans = [s.plan.at(self._counted(s)) for s in seqs]
        shared = max(p.weights + p.working + p.transient for p in plans)
        return shared + sum(p.kv for p in plans) + max(p.reserve for p in plans)

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join now: nothing parked waits before it, a free row, the
        same layers on disk as the batch, and within the budget beside the batch."""
        if self.parked and seq is not self.parked[0]:
            return False
        if not self.running:
            return True
        if len(self.running) >= self.max_batch or seq.offloaded != tuple(self.engine.swap.offloaded):
            return False
        budget = self.engine.budget.bytes
        return budget is None or self._need(self.running + [seq]) <= budget

    def admit(self, seq: Sequence) -> None:
        """Start `seq` in the batch (the caller checked `fits`)."""
        if not self.running:
            self.engine.swap.offload(seq.offloaded)
        budget = self.engine.budget.bytes
        # Stored states in memory keep out of what the batch needs now and of what this
        # sequence needs at its plan's end (alone, nothing is set aside to make room).
        need = max(self._need(self.running + [seq]), seq.plan.total)
        seq.start(None if budget is None else max(0, budget - need))
        self._admitted += 1
        seq.admitted = self._admitted
        self.running.append(seq)

    def _resume(self) -> None:
        """Parked sequences back, oldest first, while they fit."""
        while self.parked and self.fits(self.parked[0]):
            seq = self.parked.pop(0)
            if not self.running:
                self.engine.swap.offload(seq.offloaded)
            self.swap_s += seq.resume()
            self.running.append(seq)
            self.running.sort(key=lambda s: s.admitted)

    def _make_room(self) -> None:
        """Park the most recently admitted sequences until the next step fits (one always runs)."""
        budget = self.engine.budget.bytes
        while budget is not None and len(self.running) > 1 and self._need(self.running) > budget:
            seq = self.running[-1]
            try:
                self.swap_s += seq.park()
            except Exception as e:  # e.g. a full disk: it keeps running, over the estimate
                log.warning("could not preempt a sequence to disk: %s", e)
                return
            self.running.pop()
            self.parked.append(seq)
            self.parked.sort(key=lambda s: s.admitted)
            self.preemptions += 1

    def step(self) -> list[tuple[Sequence, Chunk | None]]:
        """One decode step for every decoding sequence (one forward for all; a lone one
        feeds its draft too, justfit.engine.sequence.Sequence.draft), then one prefill chunk; what each
        produced, in order (None: a prefill chunk that is not the prompt's last).
        Finished sequences leave the batch, their state stored."""
        out: list[tuple[Sequence, Chunk | None]] = []
        if self.preempt:
            self._resume()
            self._make_room()
        decoding = [s for s in self.running if s.pending is not None]
        # Drafts fill a step's rows when one sequence decodes; several already fill them
        # in one batched forward (each weight read once), which drafts verified apart would split.
        drafts = {id(s): s.draft() if len(decoding) == 1 else [] for s in decoding}
        plain = [s for s in decoding if not drafts[id(s)]]
        for group in self._groups(plain):
            with self.engine.swap.phase("decode") as phase:
                logits = decode_step(self.engine.model, [s.pending for s in group], [s.cache for s in group])
            self.steps += 1
            if len(group) == 1:  # what a draft must beat (justfit.engine.speculate.draft_length)
                self.engine.step_costs.note(1, phase.seconds)
            for i, s in enumerate(group):
                s.note_phase(phase)
                s.fed()
                out.append((s, s.accept(logits[i])))
        for s in decoding:
            if drafts[id(s)]:
                with self.engine.swap.phase("decode") as phase:
                    logits = verify_step(self.engine.model, [s.pending] + drafts[id(s)], s.cache)
                self.steps += 1
                self.engine.step_costs.note(1 + len(drafts[id(s)]), phase.seconds)
                s.note_phase(phase)
                out.extend((s, chunk) for chunk in s.verify(drafts[id(s)], logits))
        waiting = [s for s in self.running if s.remaining > 0]
        if waiting:
            seq = min(waiting, key=lambda s: s.remaining)  # shortest remaining prefill first
            out.append((seq, seq.prefill(self.step_tokens if decoding else None)))
        if self._trim and (waiting or self.steps % 16 == 0):
            trim_heap()
        for s in [s for s in self.running if s.finished]:
            self.leave(s)
        return out

    def leave(self, seq: Sequence) -> None:
        """Take `seq` out of the batch, running or parked (finished, cancelled or
        failed), storing what it computed."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.parked:
            self.parked.remove(seq)
        seq.store()
        if not self.running and not self.parked:  # as after a lone request: stored states back within what the budget leaves
            e = self.engine
            e.states.fit(e.planner.state_allowance(e.planner.footprint(1, e.swap.offloaded)))

    def _groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """The decoding sequences as batched steps: all paged ones together, any other
        alone (each alone where every forward computes one row: justfit.engine.numerics)."""
        paged = [s for s in seqs if batchable(s.cache)] if not self.engine.numerics.one_row else []
        return ([paged] if paged else []) + [[s] for s in seqs if s not in paged]


def run_alone(engine, seq: Sequence, progress: ProgressFn | None = None) -> Iterator[Chunk]:
    """Run `seq` as a batch of one on `engine`, streaming its chunks; `progress(done,
    total)` after each prefill chunk. Closing the iterator early stops it between
    steps, the state computed so far stored."""
    runner = BatchRunner(engine, max_batch=1)
    measure = measure_request(engine.planner)
    runner.admit(seq)
    try:
        if progress:
            progress(len(seq.held), len(seq.tokens))
        while not seq.finished:
            prefilling = seq.remaining > 0
            chunks = [c for _, c in runner.step() if c is not None]
            if progress and prefilling:
                progress(len(seq.tokens) - seq.remaining, len(seq.tokens))
            yield from chunks
    finally:
        if seq in runner.running or seq in runner.parked:  # cancelled or failed: stored as computed
            runner.leave(seq)
        measure.done(seq.plan, len(seq.held), seq.stats.memory)


def run_all(runner: BatchRunner, seqs: list[Sequence]) -> Iterator[tuple[Sequence, Chunk | None]]:
    """Run `seqs` on `runner` until every one ends, admitting them in order as they fit;
    what each step produced (BatchRunner.step)."""
    waiting = list(seqs)
    while waiting or runner.running or runner.parked:
        while waiting and runner.fits(waiting[0]):
            runner.admit(waiting.pop(0))
        yield from runner.step()

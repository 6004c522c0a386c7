"""The forward of one step of the scheduler's loop (justfit.engine.scheduler): every
decoding sequence fed its next token in one forward pass (the rows share the weights and
nothing else: each row attends over its own pages, kvexec.batch_cache), a lone decoding
sequence's draft verified in the same forward (justfit.engine.sequence.Sequence.draft),
then one prefill chunk of the sequence with the fewest prompt tokens left (at most
`step_tokens` while others decode), so a short request that arrives during a long
prefill gets its first token after at most one of the long prompt's chunks, and then
keeps its pace.

With a `Pipeline` (EngineConfig.pipeline), a step whose decoding sequences decide their
next tokens without the host builds the next step's forward from those tokens, not yet
evaluated, and dispatches it (`mx.async_eval`) before taking them on the host: stop
text, detokenizing and the chunks happen while it computes, as mlx-lm's `generate_step`
does. The next step takes it if its batch is the same; otherwise (a sequence ended,
joined, was parked or cancelled) the position it fed is dropped from every cache and
the step runs as it would have (`Pipeline.settle`), so replies and stored states do not
depend on it.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from justfit.engine.sequence import Sequence
from justfit.engine.stats import Chunk
from kvexec.batch_cache import batch_caches
from kvexec.cache import PagedKVCache

Produced = list[tuple[Sequence, Chunk | None]]  # what each sequence produced, in order (None: a prefill chunk)


def decode_step(model: nn.Module, tokens: list[int], caches: list[list]) -> mx.array:
    """Feed token i to sequence i (its cache list `caches[i]`); the next logits, fp32
    [B, vocab], evaluated with every sequence's new keys and values."""
    return decode_rows(model, tokens, caches)[0]


def decode_rows(model: nn.Module, tokens: list[int], caches: list[list],
                choose: Callable[[mx.array], list[mx.array | None]] | None = None
                ) -> tuple[mx.array, list[mx.array | None]]:
    """`decode_step`, and what `choose(logits)` computes from the logits (a greedy row's
    token) evaluated with them: one wait for the step, not a second one for the token."""
    if len(tokens) != len(caches) or not tokens:
        raise ValueError(f"{len(tokens)} tokens for {len(caches)} sequences")
    layers = batch_caches(caches) if len(caches) > 1 else caches[0]
    logits = model(mx.array(tokens)[:, None], cache=layers)[:, -1].astype(mx.float32)
    chosen = choose(logits) if choose is not None else []
    mx.eval(logits, [c for c in chosen if c is not None], [c.state for c in layers])
    return logits, chosen


def launch_rows(model: nn.Module, tokens: mx.array, caches: list[list],
                choose: Callable[[mx.array], list[mx.array | None]]) -> tuple[mx.array, list[mx.array | None]]:
    """`decode_rows` for `tokens` [B] not yet evaluated, dispatched without waiting."""
    layers = batch_caches(caches) if len(caches) > 1 else caches[0]
    logits = model(tokens.astype(mx.int32)[:, None], cache=layers)[:, -1].astype(mx.float32)
    chosen = choose(logits)
    mx.async_eval(logits, [c for c in chosen if c is not None], [c.state for c in layers])
    return logits, chosen


class Pipeline:
    """The decode step dispatched ahead, if any: `group` fed the tokens their last step
    chose (the host has not taken them yet), its `logits` and `chosen` tokens in flight."""

    def __init__(self):
        self.group: list[Sequence] = []
        self.logits: mx.array | None = None
        self.chosen: list[mx.array | None] = []
        self.taken = self.undone = 0  # steps dispatched ahead and taken, or undone

    @property
    def ahead(self) -> bool:
        """Whether a step is dispatched ahead."""
        return self.logits is not None

    def take(self, decoding: list[Sequence]) -> tuple[mx.array, list[mx.array | None]] | None:
        """The step dispatched ahead, when `decoding` is the batch it was built for;
        otherwise it is undone (None)."""
        if not self.ahead:
            return None
        if [id(s) for s in decoding] != [id(s) for s in self.group]:
            self.settle()
            return None
        logits, chosen = self.logits, self.chosen
        self.discard()
        self.taken += 1
        return logits, chosen

    def settle(self) -> None:
        """Undo the step dispatched ahead, if any: waited for, then its position dropped
        from each sequence's cache (and its draw from a sampled one's position)."""
        if not self.ahead:
            return
        group, logits, chosen = self.group, self.logits, self.chosen
        self.discard()
        self.undone += 1
        mx.eval(logits, [c for c in chosen if c is not None])
        for s in group:
            if s.cache is not None:
                s.take_back()

    def discard(self) -> None:
        """Forget the step dispatched ahead (after a failed step the caches are unknown anyway)."""
        for s in self.group:
            s.pipeline = None
        self.group, self.logits, self.chosen = [], None, []


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


def forward(engine, live: list[Sequence], step_tokens: int, pipe: Pipeline | None = None) -> tuple[Produced, int]:
    """One step over the sequences computing now (see the module doc): what each
    produced, in order (None: a prefill chunk that is not the prompt's last), and how
    many decode forwards it took. With `pipe`, the step it holds is taken (or undone)
    and the next one dispatched ahead where the batch allows."""
    out: Produced = []
    decoding = [s for s in live if s.pending is not None]
    ahead = pipe.take(decoding) if pipe is not None else None
    # Drafts fill a step's rows when one sequence decodes; several already fill them
    # in one batched forward (each weight read once), which drafts verified apart would split.
    # Tokens a grammar forces go with their sequence's pending one whatever the batch.
    # (A step dispatched ahead was built only where no sequence drafts.)
    drafts = {id(s): [] if ahead else s.draft(guess=len(decoding) == 1) for s in decoding}
    plain = [s for s in decoding if not drafts[id(s)]]
    groups = _groups(engine, plain)
    # The next step goes ahead when this one is one forward over every sequence and the
    # next would be the same one: nothing prefilling, drafted or needing the host.
    steady = (pipe is not None and len(groups) == 1 and len(groups[0]) == len(live) and not engine.swap.offloaded
              and all(s.may_feed_ahead(alone=len(live) == 1) for s in live))
    forwards = 0
    for group in groups:
        out.extend(_decode(engine, group, ahead, pipe if steady else None))
        forwards += 1
    for s in decoding:
        if drafts[id(s)]:
            with engine.swap.phase("decode") as phase:
                logits = verify_step(engine.model, [s.pending] + drafts[id(s)], s.cache)
            forwards += 1
            engine.step_costs.note(1 + len(drafts[id(s)]), phase.seconds)
            s.note_phase(phase)
            out.extend((s, chunk) for chunk in s.verify(drafts[id(s)], logits))
    waiting = [s for s in live if s.remaining > 0]
    if waiting:
        seq = min(waiting, key=lambda s: s.remaining)  # shortest remaining prefill first
        out.append((seq, seq.prefill(step_tokens if decoding else None)))
    return out, forwards


def _decode(engine, group: list[Sequence], ahead: tuple[mx.array, list] | None, pipe: Pipeline | None) -> Produced:
    """One decode forward for `group` (the step dispatched `ahead`, when given); with
    `pipe`, the next one dispatched ahead of taking this one's tokens."""
    def choose(rows: mx.array) -> list[mx.array | None]:
        return [s.decoder.choice(rows[i]) for i, s in enumerate(group)]

    launched = False
    with engine.swap.phase("decode") as phase:
        if ahead is not None:
            logits, chosen = ahead
        else:
            logits, chosen = decode_rows(engine.model, [s.pending for s in group], [s.cache for s in group], choose)
        if pipe is not None and all(c is not None for c in chosen):
            tokens = mx.concatenate([c.reshape(-1) for c in chosen])
            pipe.logits, pipe.chosen = launch_rows(engine.model, tokens, [s.cache for s in group], choose)
            pipe.group, launched = list(group), True
            for s in group:
                s.pipeline = pipe
    # What a draft must beat (justfit.engine.speculate.draft_length): a step timed alone.
    if len(group) == 1 and ahead is None and not launched:
        engine.step_costs.note(1, phase.seconds)
    out: Produced = []
    for i, s in enumerate(group):
        s.note_phase(phase)
        s.fed()
        out.append((s, s.accept(logits[i], chosen[i])))
    if launched and any(s.finished for s in group):  # the batch changes: the step ahead is undone
        pipe.settle()
    return out


def _groups(engine, seqs: list[Sequence]) -> list[list[Sequence]]:
    """The decoding sequences as batched steps: all paged ones together, any other
    alone (each alone where every forward computes one row: justfit.engine.numerics)."""
    paged = [s for s in seqs if batchable(s.cache)] if not engine.numerics.one_row else []
    return ([paged] if paged else []) + [[s] for s in seqs if s not in paged]

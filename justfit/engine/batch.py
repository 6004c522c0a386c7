"""The forward of one step of the scheduler's loop (justfit.engine.scheduler): every
decoding sequence fed its next token in one forward pass (the rows share the weights and
nothing else: each row attends over its own pages, kvexec.batch_cache), a lone decoding
sequence's draft verified in the same forward (justfit.engine.sequence.Sequence.draft),
then one prefill chunk of the sequence with the fewest prompt tokens left (at most
`step_tokens` while others decode), so a short request that arrives during a long
prefill gets its first token after at most one of the long prompt's chunks, and then
keeps its pace.
"""

from __future__ import annotations

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


def forward(engine, live: list[Sequence], step_tokens: int) -> tuple[Produced, int]:
    """One step over the sequences computing now (see the module doc): what each
    produced, in order (None: a prefill chunk that is not the prompt's last), and how
    many decode forwards it took."""
    out: Produced = []
    decoding = [s for s in live if s.pending is not None]
    # Drafts fill a step's rows when one sequence decodes; several already fill them
    # in one batched forward (each weight read once), which drafts verified apart would split.
    # Tokens a grammar forces go with their sequence's pending one whatever the batch.
    drafts = {id(s): s.draft(guess=len(decoding) == 1) for s in decoding}
    plain = [s for s in decoding if not drafts[id(s)]]
    forwards = 0
    for group in _groups(engine, plain):
        with engine.swap.phase("decode") as phase:
            logits = decode_step(engine.model, [s.pending for s in group], [s.cache for s in group])
        forwards += 1
        if len(group) == 1:  # what a draft must beat (justfit.engine.speculate.draft_length)
            engine.step_costs.note(1, phase.seconds)
        for i, s in enumerate(group):
            s.note_phase(phase)
            s.fed()
            out.append((s, s.accept(logits[i])))
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


def _groups(engine, seqs: list[Sequence]) -> list[list[Sequence]]:
    """The decoding sequences as batched steps: all paged ones together, any other
    alone (each alone where every forward computes one row: justfit.engine.numerics)."""
    paged = [s for s in seqs if batchable(s.cache)] if not engine.numerics.one_row else []
    return ([paged] if paged else []) + [[s] for s in seqs if s not in paged]

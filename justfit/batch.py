"""Several requests at once on one engine: the batched decode step and the runner that
interleaves prefill chunks with it.

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

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from justfit.batch_sequence import Sequence
from justfit.stats import Chunk
from kvexec.batch_cache import batch_caches
from kvexec.cache import PagedKVCache

if TYPE_CHECKING:
    from justfit.engine import Engine


def decode_step(model: nn.Module, tokens: list[int], caches: list[list]) -> mx.array:
    """Feed token i to sequence i (its cache list `caches[i]`); the next logits, fp32
    [B, vocab], evaluated with every sequence's new keys and values."""
    if len(tokens) != len(caches) or not tokens:
        raise ValueError(f"{len(tokens)} tokens for {len(caches)} sequences")
    layers = batch_caches(caches) if len(caches) > 1 else caches[0]
    logits = model(mx.array(tokens)[:, None], cache=layers)[:, -1].astype(mx.float32)
    mx.eval(logits, [c.state for c in layers])
    return logits


def batched_decode(engine: Engine, tokens: list[int], caches: list[list]) -> mx.array:
    """`decode_step` as one decode phase of `engine` (resident weights): the next
    logits, fp32 [B, vocab]."""
    with engine.swap.phase("decode"):
        return decode_step(engine.model, tokens, caches)


def batchable(cache: list) -> bool:
    """Whether a sequence's cache can share a batched step (every layer paged; a
    recurrent state cannot be split by row)."""
    return all(isinstance(c, PagedKVCache) for c in cache)


class BatchRunner:
    """The sequences running on `engine`, at most `max_batch` at once."""

    def __init__(self, engine: Engine, max_batch: int = 4, step_tokens: int = 128):
        if max_batch < 1 or step_tokens < 1:
            raise ValueError("max_batch and step_tokens must be >= 1")
        # While any sequence decodes, a step's prefill chunk is at most step_tokens, so
        # the decoding replies keep their pace during a long prefill.
        self.engine, self.max_batch, self.step_tokens = engine, max_batch, step_tokens
        self.running: list[Sequence] = []
        self.steps = 0  # decode steps taken, for stats

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join now: a free row, the same layers on disk as the batch,
        and within the budget the batch's plans with its own (weights and the largest
        transient once, every sequence's KV)."""
        if not self.running:
            return True
        if len(self.running) >= self.max_batch or seq.offloaded != tuple(self.engine.swap.offloaded):
            return False
        budget = self.engine.config.budget_bytes
        if budget is None:
            return True
        plans = [s.plan for s in self.running] + [seq.plan]
        shared = max(p.weights + p.working + p.transient for p in plans)
        need = shared + sum(p.kv for p in plans)
        return need + max(p.reserve for p in plans) <= budget

    def admit(self, seq: Sequence) -> None:
        """Start `seq` in the batch (the caller checked `fits`)."""
        if not self.running:
            self.engine.swap.offload(seq.offloaded)
        budget = self.engine.config.budget_bytes
        others = sum(s.plan.total for s in self.running)
        seq.start(None if budget is None else max(0, budget - others - seq.plan.total))
        self.running.append(seq)

    def step(self) -> list[tuple[Sequence, Chunk | None]]:
        """One decode step for every decoding sequence, then one prefill chunk; what each
        produced (None: a prefill chunk that is not the prompt's last). Finished
        sequences leave the batch, their state stored."""
        out: list[tuple[Sequence, Chunk | None]] = []
        decoding = [s for s in self.running if s.pending is not None]
        if decoding:
            for group in self._groups(decoding):
                logits = batched_decode(self.engine, [s.pending for s in group], [s.cache for s in group])
                self.steps += 1
                for i, s in enumerate(group):
                    s.fed()
                    out.append((s, s.accept(logits[i])))
        waiting = [s for s in self.running if s.remaining > 0]
        if waiting:
            seq = min(waiting, key=lambda s: s.remaining)  # shortest remaining prefill first
            out.append((seq, seq.prefill(self.step_tokens if decoding else None)))
        for s in [s for s in self.running if s.finished]:
            self.leave(s)
        return out

    def leave(self, seq: Sequence) -> None:
        """Take `seq` out of the batch (finished, cancelled or failed), storing what it computed."""
        if seq in self.running:
            self.running.remove(seq)
        seq.store()
        if not self.running:  # as after a lone request: stored states back within what the budget leaves
            e = self.engine
            e.states.fit(e.state_allowance(e.footprint(1, e.swap.offloaded)))

    @staticmethod
    def _groups(seqs: list[Sequence]) -> list[list[Sequence]]:
        """The decoding sequences as batched steps: all paged ones together, any other alone."""
        paged = [s for s in seqs if batchable(s.cache)]
        return ([paged] if paged else []) + [[s] for s in seqs if s not in paged]

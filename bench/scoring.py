"""Teacher-forced scoring shared by every system the quality suite measures: which
tokens of the text are fed and which positions are scored, and the tallies (top-1
agreement, KL, negative log-likelihood) of a system's next-token predictions against
its reference's.

Two layouts. One sequence (`context` None): the first `tokens` tokens in one cache,
every position scored. Windows (`context` N): llama-perplexity's layout, so the rows of
every engine score the same token positions: `chunks` independent windows of N tokens
cut from the start of the text, each in a fresh cache, its first token replaced by the
model's BOS where its tokenizer adds one, and only the predictions from position N/2 to
N-2 scored (each of those has N/2 or more tokens before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    """Which tokens are fed and which predictions are scored."""

    tokens: int  # tokens of the text used (windows: context x chunks)
    context: int | None = None  # window length; None: one sequence of `tokens`
    bos: int | None = None  # the BOS each window starts with, where the tokenizer adds one

    def __post_init__(self) -> None:
        if self.context is not None and (self.context < 4 or self.tokens < self.context):
            raise ValueError(f"windows need a context >= 4 and tokens >= context, not {self.context}, {self.tokens}")
        if self.tokens < 2:
            raise ValueError("at least 2 tokens are needed to score a prediction")

    @property
    def chunks(self) -> int:
        return 1 if self.context is None else self.tokens // self.context

    @property
    def first(self) -> int:
        """The first scored position in each window."""
        return 0 if self.context is None else self.context // 2

    @property
    def scored(self) -> int:
        """Predictions scored in all: llama-perplexity's count, (N - 1 - N/2) a window."""
        length = self.tokens if self.context is None else self.context
        return self.chunks * (length - 1 - self.first)

    def windows(self, ids: list[int]) -> list[list[int]]:
        """The fed token windows of the text's `ids` (each with its last token, whose
        prediction has no target: feeding it changes no earlier one)."""
        if len(ids) < self.tokens:
            raise ValueError(f"the text has only {len(ids)} tokens, {self.tokens} needed")
        if self.context is None:
            return [list(ids[: self.tokens])]
        out = []
        for c in range(self.chunks):
            window = list(ids[c * self.context : (c + 1) * self.context])
            if self.bos is not None:
                window[0] = self.bos  # as llama-perplexity starts every chunk
            out.append(window)
        return out

    def describe(self) -> dict:
        """The fields a result row carries to say which predictions it scored."""
        if self.context is None:
            return {"tokens": self.tokens, "scored": self.scored}
        return {"tokens": self.tokens, "context": self.context, "chunks": self.chunks, "scored": self.scored,
                "scored_positions": f"{self.first}..{self.context - 2} of each window",
                "window_start": "BOS" if self.bos is not None else "the text's token"}


def adds_bos(tokenizer) -> int | None:
    """The BOS id `tokenizer` puts before a text, or None where it adds none."""
    with_bos = list(tokenizer.encode("x"))
    plain = list(tokenizer.encode("x", add_special_tokens=False))
    return with_bos[0] if len(with_bos) > len(plain) else None


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class Tally:
    """Sums over scored predictions of one system against its reference."""

    def __init__(self) -> None:
        self.agree, self.kl, self.nll, self.count = 0, 0.0, 0.0, 0

    def add(self, lp: np.ndarray, ref_lp: np.ndarray, ref_p: np.ndarray, targets: np.ndarray) -> None:
        """Rows of log-probabilities `lp` against the reference's (`ref_p` = exp(ref_lp)),
        each predicting the token in `targets`."""
        self.agree += int((lp.argmax(axis=-1) == ref_lp.argmax(axis=-1)).sum())
        self.kl += float((ref_p * (ref_lp - lp)).sum())
        self.nll -= float(np.take_along_axis(lp, targets[:, None], axis=-1).sum())
        self.count += len(targets)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def row(self, reference: "Tally") -> dict:
        """top1, kl (mean nats a prediction), ppl and ppl_delta against `reference`'s perplexity."""
        return {"top1": self.agree / self.count, "kl": self.kl / self.count, "ppl": self.ppl,
                "ppl_delta": self.ppl / reference.ppl - 1}


def score(layout: Layout, ids: list[int], reference, systems: dict, chunk: int = 512, progress=None) -> dict:
    """Teacher-force `ids` through `reference` and every system in lockstep, window by
    window: `reference` and each value of `systems` are (make_cache() -> cache,
    forward(x, cache) -> logits as float32 numpy [tokens, vocab]). Returns name -> Tally,
    the reference's under "reference"."""
    tallies = {name: Tally() for name in ["reference", *systems]}
    for window in layout.windows(ids):
        caches = {name: make() for name, (make, _) in [("reference", reference), *systems.items()]}
        forward = {"reference": reference[1], **{name: f for name, (_, f) in systems.items()}}
        fed = window[:-1]
        for start in range(0, len(fed), chunk):
            piece = fed[start : start + chunk]
            keep = max(0, layout.first - start)  # rows before the first scored position are fed, not scored
            targets = np.array(window[start + 1 + keep : start + 1 + len(piece)])
            ref_lp = None
            for name in tallies:
                logits = forward[name](piece, caches[name])
                if keep >= len(piece):
                    continue
                lp = log_softmax(logits[keep:])
                if ref_lp is None:  # the reference is first
                    ref_lp, ref_p = lp, np.exp(lp)
                tallies[name].add(lp, ref_lp, ref_p, targets)
            if progress:
                progress(len(piece))
    return tallies

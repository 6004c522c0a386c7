"""Speculative decoding in the request path (justfit.engine.sequence, justfit.engine.scheduler): drafts
verified in one forward give the reply plain decoding gives, with rejected positions
dropped from the cache; a reply that ends inside a draft stores only what plain
decoding would have fed; drafts run inside a batch (in the steps where one sequence
decodes: several share one forward instead) and through preemption to disk;
sampled replies keep their distribution; a request can turn drafting off; and on the
real SmolLM2 a code edit is drafted with the text unchanged. The
drafter and the acceptance rule alone: tests/engine/test_draft.py, tests/engine/test_speculate.py;
the page store's rollback: tests/kvexec/test_kv_rollback.py."""

from __future__ import annotations

import inspect
import textwrap

import numpy as np
import pytest

from bench.loop import run_all
from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.engine.scheduler import Scheduler, plan_sequence
from justfit.engine.sequence import Sequence
from justfit.engine.stats import collect


class Oracle:
    """Drafts the reply known in advance (`reply`, the plain decode's tokens), every
    `wrong`-th token changed so the model rejects it: verifies with full, partial and
    no acceptance, and rollback of the rejected positions."""

    max_draft = 6
    active = True

    def __init__(self, prompt: list[int], reply: list[int], wrong: int = 4):
        self.prompt_len, self.reply, self.wrong = len(prompt), reply, wrong
        self.seen = list(prompt)
        self.verifies = 0

    def extend(self, tokens: list[int]) -> None:
        self.seen.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        at = len(self.seen) - self.prompt_len  # reply tokens emitted so far
        out = self.reply[at:at + min(limit, self.max_draft)]
        return [t + 1 if (at + i) % self.wrong == self.wrong - 1 else t for i, t in enumerate(out)]

    def feedback(self, drafted: int, accepted: int) -> None:
        self.verifies += 1


class _FlatCosts:
    """Step costs equal whatever the rows: a draft always pays. How much is drafted then
    does not hang on how long this machine's steps happened to take, which the identity
    tested here does not depend on (draft_length itself: tests/engine/test_speculate.py)."""

    def cost(self, rows: int) -> float:
        return 1.0


@pytest.fixture
def drafts_always_pay(monkeypatch):
    import justfit.engine.drafting as drafting_module

    real = drafting_module.draft_length
    monkeypatch.setattr(drafting_module, "draft_length", lambda proposed, acceptance, costs:
                        real(proposed, acceptance, _FlatCosts()))


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _run(engine: Engine, prompt: list[int], sp: SamplingParams, drafter=None) -> tuple[list[int], str, Sequence]:
    """The reply's tokens and text run alone in a batch of one, and its sequence."""
    seq = plan_sequence(engine, prompt, sp, drafter=drafter)
    reply = collect(c for _, c in run_all(Scheduler(engine, serve=False), [seq]) if c is not None)
    return reply.tokens, reply.text, seq


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tiny_llama_dir, tiny_gemma3_dir):
    path = tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
    return Engine(str(path), config=EngineConfig(prefill_chunk=32))


PROMPT = [(11 * j) % 240 + 3 for j in range(45)]


@pytest.mark.usefixtures("drafts_always_pay")
def test_drafted_greedy_reply_equals_plain_and_stores_the_same_state(engine):
    engine.reset()
    plain, _, _ = _run(engine, PROMPT, _greedy(40, speculate=False))
    stored_plain = engine.states.last
    held_plain = list(stored_plain.tokens)
    engine.reset()
    got, _, seq = _run(engine, PROMPT, _greedy(40), lambda p: Oracle(p, plain))
    assert got == plain
    s = seq.stats
    assert s.drafted_tokens > s.accepted_tokens > 0  # full, partial and rejected drafts all ran
    assert seq.drafter.verifies > 5
    entry = engine.states.last  # only fed tokens reach the stored state, exactly as without drafts
    assert list(entry.tokens) == held_plain == PROMPT + plain[:-1]
    assert all(c.offset == len(entry.tokens) for c in entry.cache)
    engine.reset()


def test_speculate_false_turns_drafting_off(engine):
    engine.reset()
    _, _, seq = _run(engine, PROMPT, _greedy(12, speculate=False), lambda p: Oracle(p, [1] * 12))
    assert seq.drafter is None and seq.stats.drafted_tokens == 0
    engine.reset()


@pytest.mark.usefixtures("drafts_always_pay")
def test_a_reply_ending_inside_a_draft_keeps_only_what_plain_decoding_fed(engine):
    engine.reset()
    plain, text, _ = _run(engine, PROMPT, _greedy(30, speculate=False))
    cut = next(i for i in range(len(text) // 2, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2])
    stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(text[cut:cut + 2],),
                          speculate=False)
    engine.reset()
    want, want_text, _ = _run(engine, PROMPT, stop)
    want_held = list(engine.states.last.tokens)
    engine.reset()
    drafted = SamplingParams(**{**stop.__dict__, "speculate": True})
    got, got_text, seq = _run(engine, PROMPT, drafted, lambda p: Oracle(p, plain, wrong=1000))
    assert (got, got_text) == (want, want_text) and seq.stats.finish_reason == "stop"
    assert seq.stats.accepted_tokens > 0
    entry = engine.states.last
    assert list(entry.tokens) == want_held and all(c.offset == len(want_held) for c in entry.cache)
    engine.reset()


@pytest.mark.usefixtures("drafts_always_pay")
def test_drafts_in_a_batch_through_preemption_to_disk(tiny_llama_dir, tmp_path):
    from tests.engine.test_batch_preempt import NEW, PROMPTS, _alone, _two_long

    engine = _two_long(tiny_llama_dir, tmp_path)
    alone = [_alone(engine, p) for p in PROMPTS]
    runner = Scheduler(engine, max_batch=4, serve=False)
    seqs = [plan_sequence(engine, p, _greedy(NEW), drafter=lambda t, a=a: Oracle(t, a)) for p, a in zip(PROMPTS, alone)]
    got = {}
    for seq, chunk in run_all(runner, seqs):
        if chunk is not None and chunk.token is not None:
            got.setdefault(id(seq), []).append(chunk.token)
    assert [got[id(s)] for s in seqs] == alone
    # Drafts run in the steps where a sequence decodes alone (the others prefilling or set aside).
    assert runner.preemptions > 0 and sum(s.stats.accepted_tokens for s in seqs) > 0


@pytest.mark.usefixtures("drafts_always_pay")
def test_sampled_replies_keep_their_distribution(tiny_llama_dir, monkeypatch):
    """The third token over many RNG seeds, drafted (a greedy guess, often wrong) and not:
    two samples of one distribution (two-sample chi-square, p = 0.001). Drafts run for
    unseeded requests only (a seeded one keeps its one reply), so the requests carry no
    seed and each one's RNG position is given here, for a reproducible test."""
    import justfit.engine.sequence

    engine = Engine(str(tiny_llama_dir), config=EngineConfig(prefill_chunk=32))
    sp = dict(temperature=0.7, top_k=6, max_tokens=3, ignore_eos=True)
    guess, _, _ = _run(engine, PROMPT, _greedy(3, speculate=False))
    seeded = _run(engine, PROMPT, SamplingParams(seed=1, **sp), lambda p: Oracle(p, guess, wrong=1000))[2]
    assert seeded.drafter is None  # a seeded sampled request decodes one token per step
    counts: dict[bool, dict[int, int]] = {True: {}, False: {}}
    drafted = 0
    for seed in range(240):
        for drafting in (True, False):
            engine.reset()
            monkeypatch.setattr(justfit.engine.sequence, "new_rng", lambda _=None, s=seed: {"seed": s, "step": 0})
            tokens, _, seq = _run(engine, PROMPT, SamplingParams(speculate=drafting, **sp),
                                  lambda p: Oracle(p, guess, wrong=1000))
            counts[drafting][tokens[2]] = counts[drafting].get(tokens[2], 0) + 1
            drafted += seq.stats.drafted_tokens
    assert drafted > 100  # most drafted runs verified a draft
    engine.reset()
    keys = sorted(set(counts[True]) | set(counts[False]))
    table = np.array([[counts[d].get(k, 0) for k in keys] for d in (True, False)], dtype=float)
    table = table[:, table.sum(axis=0) >= 5]  # categories seen often enough for the test
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    # The chi-square distribution's upper 0.001 quantile (Wilson-Hilferty; z = 3.09).
    assert df >= 1 and chi2 < df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3


def test_smollm2_code_edit_drafts_with_the_same_text(smollm2_gguf):
    """How much is drafted depends on the step costs this machine measures as it runs
    (justfit.engine.speculate.draft_length): here only that drafts ran and the text held."""
    source = inspect.getsource(textwrap.indent)
    msgs = [{"role": "user", "content": "Repeat this Python code exactly, renaming indent to add_prefix.\n\n"
             + source}]
    replies = {}
    for draft in ("none", "ngram"):
        engine = Engine(str(smollm2_gguf), config=EngineConfig(draft=draft))
        replies[draft] = engine.reply(msgs, SamplingParams(temperature=0, max_tokens=120))
    plain, drafted = replies["none"], replies["ngram"]
    assert drafted.text == plain.text and plain.stats.drafted_tokens == 0
    assert drafted.stats.drafted_tokens > 0 and drafted.stats.accepted_tokens > 0

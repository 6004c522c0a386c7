"""Prompt-lookup drafts (justfit.engine.draft): the continuation of a repeated span, nothing for
novel text, a draft length that follows acceptance, a pause where drafts keep failing,
and an index a 100K-token prompt builds in well under a second."""

from __future__ import annotations

import random
import time

import pytest

from justfit.engine.draft import NgramDrafter, continuation, replay


def _novel(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).sample(range(10_000, 60_000), n)  # distinct tokens: no n-gram repeats


def test_proposes_what_followed_the_earlier_occurrence():
    span = _novel(40)
    d = NgramDrafter(span + _novel(10, seed=1) + span[:5], max_draft=16)
    assert d.propose(100) == span[5:5 + d.draft_len]
    assert d.propose(3) == span[5:8]
    d.extend(span[5:8])  # the reply goes on copying: the draft follows
    assert d.propose(4) == span[8:12]


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    a, b, c, d_, x, y = 1, 2, 3, 4, 50, 60
    tokens = [a, b, c, d_, x, 9, 9, 9, c, d_, y, 8, 8, 8, a, b, c, d_]
    # (c, d) last came before y, but (a, b, c, d) matches only before x
    assert NgramDrafter(tokens).propose(1) == [x]
    assert NgramDrafter(tokens, max_ngram=2).propose(1) == [y]


def test_nothing_for_novel_text_and_the_suffix_never_matches_itself():
    d = NgramDrafter(_novel(500))
    assert d.propose(8) == []
    d.extend(_novel(20, seed=3))
    assert d.propose(8) == []


def test_a_loop_running_past_the_end_repeats_its_period():
    assert NgramDrafter([5, 6, 5, 6, 5, 6]).propose(6) == [5, 6, 5, 6, 5, 6]
    assert continuation([1, 2, 3, 7, 1, 2, 3], 3, 5) == [7, 1, 2, 3, 7]


def test_draft_length_grows_on_full_acceptance_and_shrinks_on_rejection():
    span = _novel(200)
    d = NgramDrafter(span + span[:4], max_draft=16)
    first = d.draft_len
    d.feedback(first, first)
    assert d.draft_len == min(16, 2 * first)
    d.feedback(d.draft_len, d.draft_len)
    assert d.draft_len == 16  # capped at max_draft
    assert len(d.propose(100)) == 16
    d.feedback(16, 2)
    assert d.draft_len == 3  # just past what held
    assert len(d.propose(100)) == 3


def test_drafting_pauses_when_acceptance_stays_low_and_probes_again():
    span = _novel(300)
    d = NgramDrafter(span + span[:4])
    while d.active:
        d.feedback(8, 0)
    assert d.propose(8) == []
    pause = d.paused_for
    assert pause > 0
    d.extend(span[4:4 + pause - 1])
    assert not d.active
    d.extend(span[4 + pause - 1:4 + pause])
    assert d.active and d.propose(8)  # the probe after the pause
    d.feedback(len(d.propose(8)), 0)  # fails again: a longer pause at once
    assert not d.active and d.paused_for > pause


def test_good_acceptance_never_pauses():
    d = NgramDrafter(_novel(100))
    for _ in range(50):
        d.feedback(4, 3)
    assert d.active


def test_replay_of_a_copied_reply_needs_few_passes_and_prose_wastes_little():
    code = _novel(300, seed=7)
    edited = code[:120] + [5, 6] + code[122:]  # one identifier renamed
    copy = replay(code + _novel(5, seed=8), edited)
    assert copy.emitted == len(edited)
    assert copy.tokens_per_pass > 5
    prose = replay(_novel(300, seed=9), [t % 97 for t in _novel(400, seed=10)])  # few repeats, mostly misses
    assert prose.emitted == 400
    assert prose.drafted - prose.accepted < 0.5 * prose.verifies


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter([1, 2], max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramDrafter([1, 2], max_draft=0)


def test_index_of_a_100k_prompt_builds_fast_and_lookups_do_not_grow_with_it():
    tokens = [random.Random(1).randrange(50_000) for _ in range(100_000)]
    start = time.perf_counter()
    d = NgramDrafter(tokens)
    assert time.perf_counter() - start < 2.0
    small = NgramDrafter(tokens[:1000])
    for drafter in (d, small):
        start = time.perf_counter()
        for t in range(2000):
            drafter.propose(8)
            drafter.extend([t])
        drafter.elapsed = time.perf_counter() - start
    assert d.elapsed < 5 * small.elapsed + 0.05

"""Pipelined decode steps (justfit.engine.batch.Pipeline, EngineConfig.pipeline): the next
step dispatched before the host takes this step's tokens changes no reply and no stored
state. Each case runs on two engines over the same weights, pipelining on and off: greedy
alone and in a batch of four whose sequences end at different steps (token limit, EOS,
a stop string), a cancelled sequence's stored state, a session continued after a
pipelined turn, seeded sampled replies; and the real SmolLM2, ending at its own EOS
in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.engine.scheduler import Scheduler, plan_sequence
from kvexec.cache import PagedKVCache
from kvexec.export import export_store

PROMPTS = ([5, 9, 13, 2, 77, 31, 8], list(range(40, 140)), [200, 3, 3, 3, 9, 120, 64, 1, 2, 33, 90, 11, 4],
           [17, 250, 6, 6, 91, 30])


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=kw.pop("ignore_eos", True), **kw)


def _seeded(n: int, seed: int = 7) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=seed, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engines(request, tiny_llama_dir, tiny_gemma3_dir, tmp_path_factory):
    """Pipelining on and off (drafts off: a lone sequence's drafts would take every step)."""
    path = tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
    return {on: Engine(str(path), config=EngineConfig(prefill_chunk=32, draft="none", pipeline=on,
                                                      state_dir=str(tmp_path_factory.mktemp(f"states-{on}"))))
            for on in (True, False)}


def _batch(engine: Engine, requests: list[tuple[list[int], SamplingParams]], cancel: dict | None = None,
           pipeline: bool = True):
    """Run `requests` in one batch (a sequence in `cancel` leaves after that many tokens;
    `pipeline` False: never pipelined, whatever the engine's setting); the chunks of
    each, the sequences, and the scheduler."""
    engine.reset()
    runner = Scheduler(engine, serve=False, max_batch=len(requests))
    if not pipeline:
        runner.pipe = None
    seqs = [plan_sequence(engine, p, sp) for p, sp in requests]
    for s in seqs:
        runner.admit(s)
    got: dict[int, list] = {id(s): [] for s in seqs}
    for _ in range(1000):
        if not runner.live:
            break
        for seq, chunk in runner.step():
            if chunk is not None:
                got[id(seq)].append(chunk)
        for i, n in (cancel or {}).items():
            s = seqs[i]
            if s in runner.live and len(got[id(s)]) >= n:
                runner.leave(s)
    return [got[id(s)] for s in seqs], seqs, runner


def _text(chunks) -> tuple[list, str, str | None]:
    return [c.token for c in chunks], "".join(c.text for c in chunks), chunks[-1].finish_reason


def _state(engine: Engine, tokens: list[int], session: str | None = None) -> tuple[list[int], list]:
    """The stored state a request for `tokens` would take: its tokens and every paged
    layer's arrays."""
    reuse = engine.states.take(tokens, session, None)
    layers = []
    for c in reuse.cache or []:
        assert isinstance(c, PagedKVCache)
        arrays, meta = export_store(c.store)
        layers.append(({k: np.array(v) for k, v in sorted(arrays.items())}, meta["offset"]))
    return list(reuse.tokens), layers


def _same_states(a, b) -> None:
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1])
    for (x, ox), (y, oy) in zip(a[1], b[1]):
        assert ox == oy and x.keys() == y.keys()
        for k in x:
            assert np.array_equal(x[k], y[k]), k


def test_greedy_alone_and_its_stored_state(engines):
    runs = {}
    for on, engine in engines.items():
        chunks, seqs, runner = _batch(engine, [(PROMPTS[1], _greedy(40))])
        runs[on] = (_text(chunks[0]), _state(engine, seqs[0].tokens + [t.token for t in chunks[0]] + [1]))
        if on:
            assert runner.pipe.taken >= 30  # nearly every step went ahead
        else:
            assert runner.pipe.taken == 0
    assert runs[True][0] == runs[False][0] and len(runs[True][0][0]) == 40
    _same_states(runs[True][1], runs[False][1])


def test_batch_of_four_ending_at_different_steps(engines):
    """Token limits of different lengths, then one sequence ending at an end token and
    one at a stop string (both taken from the unpipelined replies' middle)."""
    off, on = engines[False], engines[True]
    limits = [(p, _greedy(n)) for p, n in zip(PROMPTS, (9, 30, 17, 24))]
    base = [_text(c) for c in _batch(off, limits)[0]]
    chunks, _, runner = _batch(on, limits)
    assert [_text(c) for c in chunks] == base
    assert runner.pipe.taken > 0 and runner.pipe.undone == 0  # a token limit is known ahead: no step goes ahead past it
    eos_token = base[1][0][6]  # the second reply's seventh token ends it
    stop = base[2][1][len(base[2][1]) // 2:][:3]  # three characters from the third reply's middle
    if not stop.strip():
        pytest.skip("the reply's middle is blank")
    requests = [limits[0], (PROMPTS[1], _greedy(30, ignore_eos=False)),
                (PROMPTS[2], _greedy(17, stop=(stop,))), limits[3]]
    replies = {}
    for flag, engine in engines.items():
        eos = engine.tokenizer.eos_token_ids
        eos.add(eos_token)
        try:
            chunks, _, runner = _batch(engine, requests)
        finally:
            eos.discard(eos_token)
        replies[flag] = [_text(c) for c in chunks]
        if flag:
            assert runner.pipe.undone >= 1  # a step ahead past an end token or a stop string
    assert replies[True] == replies[False]
    ended = replies[False][1][0]
    assert replies[False][1][2] == "stop" and ended[-1] is None and len(ended) <= 7  # at the end token (never shown)
    assert replies[False][2][2] == "stop" and len(replies[False][2][0]) < 17


def test_a_cancelled_sequence_stores_the_same_state(engines):
    requests = [(PROMPTS[0], _greedy(20)), (PROMPTS[2], _greedy(30))]
    runs = {}
    for on, engine in engines.items():
        chunks, seqs, runner = _batch(engine, requests, cancel={1: 5})
        tokens = [c.token for c in chunks[1]]
        assert len(tokens) == 5
        runs[on] = ([_text(c) for c in chunks], _state(engine, seqs[1].tokens + tokens + [1]))
        if on:
            assert runner.pipe.undone >= 1
    assert runs[True][0] == runs[False][0]
    _same_states(runs[True][1], runs[False][1])
    assert len(runs[True][1][0]) == len(PROMPTS[2]) + 4  # the last token was never fed


def test_a_session_continued_after_pipelined_turns(engines):
    replies, states = {}, {}
    for on, engine in engines.items():
        engine.reset()
        first = list(engine.generate(PROMPTS[0], _greedy(25), session="talk"))
        turn = PROMPTS[0] + [c.token for c in first] + [3, 4, 5]
        second = list(engine.generate(turn, _seeded(20), session="talk"))
        replies[on] = (_text(first), _text(second))
        states[on] = _state(engine, turn + [c.token for c in second] + [6], "talk")
    assert replies[True] == replies[False]
    _same_states(states[True], states[False])


def test_seeded_sampled_replies_alone_and_batched(engines):
    requests = [(p, _seeded(n, seed=i)) for i, (p, n) in enumerate(zip(PROMPTS, (25, 12, 20, 16)))]
    runs = {}
    for on, engine in engines.items():
        alone, _, runner = _batch(engine, requests[:1])
        batched, seqs, _ = _batch(engine, requests)
        runs[on] = ([_text(alone[0])], [_text(c) for c in batched], [s.rng for s in seqs])
        if on:
            assert runner.pipe.taken > 0
    assert runs[True] == runs[False]


def test_smollm2_batch_ending_at_its_end_token_and_a_stop_string(smollm2_gguf):
    """A short answer ends at SmolLM2's end token while another decodes on, to a stop string."""
    engine = Engine(str(smollm2_gguf), config=EngineConfig(draft="none"))
    requests = [(engine.encode([{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]),
                 _greedy(12, ignore_eos=False)),
                (engine.encode([{"role": "user", "content": "Name three colors, separated by commas."}]),
                 _greedy(12, ignore_eos=False, stop=(",",)))]
    replies = {}
    for on in (True, False):
        chunks, _, runner = _batch(engine, requests, pipeline=on)
        replies[on] = [_text(c) for c in chunks]
        if on:
            assert runner.pipe.taken > 0 and runner.pipe.undone == 2
    assert replies[True] == replies[False]
    (short, _, why), (colors, text, stop) = replies[False]
    assert why == "stop" and short[-1] is None and len(short) < len(colors)  # its end token, never shown
    assert stop == "stop" and "," not in text and len(colors) < 12

"""Engine mechanics on tiny random models: streaming, kept conversation state,
cancellation, stops, sampling, limits and memory accounting."""

import mlx.core as mx
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from phaseswap.policy import default_policy
from justfit.errors import BudgetExceeded, ContextTooLong
from justfit.engine.stops import StopMatcher
from tests.helpers.tiny_models import write_mlx_folder

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return Engine(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def gemma(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir))


def _tokens(engine, prompt, sp=GREEDY):
    return [c.token for c in engine.generate(prompt, sp) if c.token is not None]


def _fresh_tokens(path, prompt, sp=GREEDY):
    return _tokens(Engine(str(path)), prompt, sp)


def test_stream_ends_with_stats(llama):
    chunks = list(llama.generate("the cat sat on", SamplingParams(temperature=0, max_tokens=5)))
    last = chunks[-1]
    assert last.finish_reason in ("length", "stop") and last.stats is not None
    st = last.stats
    assert st.prompt_tokens == len(llama.encode("the cat sat on"))
    assert 1 <= st.generated_tokens <= 5
    assert st.prefill_s > 0 and st.memory.weights > 0 and st.memory.mlx_peak >= st.memory.weights
    assert llama.policy.name == default_policy() and st.memory.rss_peak > 0


def test_conversation_state_is_reused_and_exact(llama, tiny_llama_dir):
    llama.reset()
    turn1 = [{"role": "user", "content": "hello there"}]
    reply = llama.complete(turn1, GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    got = llama.reply(turn2, GREEDY)
    assert got.stats.cached_tokens > len(llama.encode(turn1)) // 2
    assert got.tokens == _fresh_tokens(tiny_llama_dir, turn2)


def test_diverging_prompt_trims_state(llama, tiny_llama_dir):
    llama.reset()
    _tokens(llama, "one two three four five six")
    got = llama.reply("one two three seven", GREEDY)
    assert 0 < got.stats.cached_tokens < len(llama.encode("one two three seven"))
    assert got.tokens == _fresh_tokens(tiny_llama_dir, "one two three seven")


def test_sliding_window_model_reuse_matches_fresh(gemma, tiny_gemma3_dir):
    gemma.reset()
    long_prompt = "the " * 40  # beyond the 16-token sliding window
    _tokens(gemma, long_prompt)
    extended = long_prompt + "and more words"
    assert _tokens(gemma, extended) == _fresh_tokens(tiny_gemma3_dir, extended)
    diverged = "the " * 30 + "other"
    assert _tokens(gemma, diverged) == _fresh_tokens(tiny_gemma3_dir, diverged)


def test_cancel_keeps_state_consistent(llama, tiny_llama_dir):
    llama.reset()
    prompt = "count with me"
    stream = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=50))
    seen = [next(stream).token for _ in range(3)]
    stream.close()
    held = llama.cached_tokens
    prompt_ids = llama.encode(prompt)
    # The state holds the prompt and exactly the tokens that were fed back in.
    assert held[: len(prompt_ids)] == prompt_ids
    assert held[len(prompt_ids):] == seen[:2]  # the 3rd was sampled, not yet fed back
    again = "count with me, then stop"
    assert _tokens(llama, again) == _fresh_tokens(tiny_llama_dir, again)


def test_stop_string_truncates_output(llama):
    llama.reset()
    full = llama.complete("abc", SamplingParams(temperature=0, max_tokens=20))
    if len(full) < 4:
        pytest.skip("tiny model produced too little text to cut")
    stop = full[2:4]
    cut = llama.reply("abc", SamplingParams(temperature=0, max_tokens=20, stop=(stop,)))
    assert cut.text == full[: full.index(stop)]
    assert cut.stats.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(llama):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
    llama.reset()
    a = _tokens(llama, "random words", sp)
    llama.reset()
    b = _tokens(llama, "random words", sp)
    assert a == b


def test_context_limit_refused_before_work(llama):
    llama.reset()
    _tokens(llama, "keep this")
    before = llama.cached_tokens
    with pytest.raises(ContextTooLong, match="512 positions"):
        list(llama.generate("hi", SamplingParams(max_tokens=10_000)))
    assert llama.cached_tokens == before


def test_budget_refused_with_numbers(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), budget="300KiB")
    with pytest.raises(BudgetExceeded) as err:
        list(engine.generate("hello", SamplingParams(max_tokens=400)))
    assert "budget 300.00 KiB" in str(err.value) and err.value.needed > err.value.budget
    assert err.value.fits_positions < err.value.positions
    assert engine.cached_tokens == []


def test_budget_below_the_smallest_request_is_refused_at_load(tiny_llama_dir):
    with pytest.raises(BudgetExceeded, match="budget 64.00 KiB"):
        Engine(str(tiny_llama_dir), budget="64KiB")


def test_planner_max_positions_is_tight(llama):
    from dataclasses import replace

    plan = llama.planner.footprint(1)
    held = replace(plan, shape=replace(plan.shape, limited=True))  # pages held to the budget's limit
    # room past a page segment under every auto policy (the MLX-only path's `cpu` too, whose
    # dense prefill transient takes most of a smaller budget)
    budget = plan.weights + 32 * 2**20
    n = plan.max_positions(budget)
    assert n > 0
    assert held.at(n).total <= budget < held.at(n + 1).total
    # a budget's store gives back unwritten room first: whole pages count, not whole segments
    assert plan.at(n).kv > held.at(n).kv


@pytest.mark.parametrize("policy", ["cpu", "cpu-exact", "cpu-compact", "quantized", "measured"])
def test_policies_compute_the_same_function(tmp_path, policy):
    path = write_mlx_folder(tmp_path / "q8", "llama", seed=3, quantize_bits=8)
    dense = Engine(str(path), config=EngineConfig(policy="dense"))
    other = Engine(str(path), config=EngineConfig(policy=policy))
    assert dense.policy.name == "dense" and other.policy.name == policy
    assert dense.planner.footprint(1).weights > other.planner.footprint(1).weights
    tokens = dense.encode("agree on this")
    a = dense.model(mx.array(tokens)[None])[0, -1]
    with other.swap.phase("prefill"):
        b = other.model(mx.array(tokens)[None])[0, -1].astype(mx.float32)
    assert mx.allclose(a, b, atol=0.05 * float(mx.abs(a).max()))


@pytest.mark.parametrize("stops,chunks,expected", [
    (("END",), ["hel", "lo E", "N", "D more"], ("hello ", True)),
    (("END",), ["hello E", "NVY"], ("hello ENVY", False)),
    (("\n\n", "###"), ["a\n", "b#", "##"], ("a\nb", True)),
    ((), ["plain ", "text"], ("plain text", False)),
])
def test_stop_matcher(stops, chunks, expected):
    m = StopMatcher(stops)
    out, hit = "", False
    for c in chunks:
        text, hit = m.feed(c)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == expected


def test_planner_counts_kv_format_and_bounded_transient(tiny_llama_dir):
    from justfit.planning.cost_model import footprint
    from kvexec import KVConfig

    engine = Engine(str(tiny_llama_dir))
    m, cfg = engine.model, engine.model_config
    stock = footprint(m, cfg, 100_000, kv=None)
    fp16 = footprint(m, cfg, 100_000, kv=KVConfig(format="fp16"))
    q4 = footprint(m, cfg, 100_000, kv=KVConfig(format="q4"))
    assert stock.kv > fp16.kv > q4.kv
    # KVExec's attention transient stops growing (at one block, and a decode step's
    # scores at TWO_PASS_SCORES); stock's grows with context
    assert footprint(m, cfg, 4_000_000, kv=KVConfig()).transient == footprint(m, cfg, 2_000_000, kv=KVConfig()).transient
    assert footprint(m, cfg, 200_000, kv=None).transient > stock.transient


def test_retention_generates_past_its_budget_but_refuses_longer_prompts(tiny_gemma3_dir):
    from kvexec import KVConfig

    kv = KVConfig(format="q4", page_size=32, hot_window=32, sink_tokens=4, max_positions=128)
    engine = Engine(str(tiny_gemma3_dir), config=EngineConfig(kv=kv))
    reply = engine.reply("a short prompt", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    assert reply.stats.generated_tokens == 300
    stores = [c.store for c in engine.states.last.cache]
    assert all(s.retained() <= 128 for s in stores)
    assert any(s.evicted > 0 for s in stores if s.window is None)  # global layers evicted
    with pytest.raises(ContextTooLong, match="retention budget"):
        list(engine.generate("x " * 200, SamplingParams(max_tokens=1)))


def test_kv_format_falls_back_to_fp16_for_small_heads(tiny_llama_dir):
    from kvexec import KVConfig

    engine = Engine(str(tiny_llama_dir), config=EngineConfig(kv=KVConfig(format="q4")))
    assert engine.config.kv.format == "fp16"  # head_dim 16 holds no 32-value group
    assert engine.complete("hello", SamplingParams(temperature=0, max_tokens=3)) is not None


def test_a_config_passed_twice_gives_identical_engines(tiny_llama_dir):
    """Engines work on their own copy: the caller's config is frozen and unchanged, and
    reusing it gives the same engine (budget, adapted KV format, tokens)."""
    import dataclasses

    from kvexec import KVConfig

    config = EngineConfig(budget_bytes=2**30, kv=KVConfig(format="q8c"))  # q8c cannot store head_dim 16
    kept = dataclasses.replace(config)
    first, second = Engine(str(tiny_llama_dir), config=config), Engine(str(tiny_llama_dir), config=config)
    assert config == kept and config.kv.format == "q8c"
    assert first.config == second.config and first.config.kv.format == "fp16"
    assert _tokens(first, "same engine") == _tokens(second, "same engine")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget_bytes = 1
    whole = EngineConfig(budget_bytes=2**30, budget_covers_process=True)
    engine = Engine(str(tiny_llama_dir), config=whole)
    assert whole.budget_bytes == 2**30 and whole.budget_covers_process  # the caller's, untouched
    assert engine.config.budget_bytes < 2**30 and not engine.config.budget_covers_process

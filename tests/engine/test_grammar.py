"""Constrained decoding (justfit.engine.grammar, justfit.engine.decoder): replies follow a
JSON schema, a regex, a Lark or a GBNF grammar, greedy and sampled; what cannot compile
(or uses keywords llguidance does not enforce) is refused naming why, a pathological
schema within the time limit without holding up another's compile; forced tokens are
counted and change no reply, nor do drafts, batching or preemption; a sampled token
follows the model's distribution renormalized over the allowed tokens; the token limit
ends a reply with "length"; the compile cache stays within its bound, which a
whole-process budget sets aside; and the real SmolLM2 answers a chat in valid JSON."""

from __future__ import annotations

import json
import re
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from bench.loop import run_all
from justfit import Engine, SamplingParams
from justfit.config import EngineConfig, OutputConstraint
from justfit.engine.grammar import Grammars
from justfit.engine.scheduler import Scheduler, plan_sequence
from justfit.engine.stats import collect
from justfit.errors import GrammarError

PROMPT = [(11 * j) % 240 + 3 for j in range(45)]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
CHOICE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", "eel"]}},
          "required": ["ok", "kind"], "additionalProperties": False}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": -999, "maximum": 999}, "minItems": 1, "maxItems": 4}


def schema_of(schema: dict) -> OutputConstraint:
    return OutputConstraint("json_schema", json.dumps(schema))


def conforms(value, schema: dict) -> bool:
    """Whether `value` follows `schema` (the keywords the schemas here use)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(conforms(v, schema["items"]) for v in value))
    if kind == "string":
        return (isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
                and re.search(schema.get("pattern", ""), value) is not None)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -1e300) <= value <= schema.get("maximum", 1e300))
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return True


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(str(tiny_llama_dir), config=EngineConfig(prefill_chunk=32))


def _greedy(constraint: OutputConstraint | None, n: int = 160, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, constraint=constraint, **kw)


def _run(engine: Engine, sp: SamplingParams, prompt=PROMPT, drafter=None):
    """The reply run alone on a scheduler of its own, and that scheduler (its forwards counted)."""
    engine.reset()
    runner = Scheduler(engine, serve=False)
    seq = plan_sequence(engine, prompt, sp, drafter=drafter)
    reply = collect(c for _, c in run_all(runner, [seq]) if c is not None)
    engine.reset()
    return reply, runner


@pytest.mark.parametrize("schema", [PERSON, CHOICE, NUMBERS])
def test_a_schema_reply_is_valid_json_greedy_and_sampled(engine, schema):
    for sp in (_greedy(schema_of(schema)),
               SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=160, constraint=schema_of(schema))):
        reply, _ = _run(engine, sp)
        assert reply.stats.finish_reason == "stop", reply.text
        assert conforms(json.loads(reply.text), schema), reply.text
        assert not re.search(r"\s", _outside_strings(reply.text)), reply.text  # compact: no whitespace between


def _outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_any_json_object_and_whitespace_stays_bounded(engine):
    reply, _ = _run(engine, SamplingParams(temperature=1.0, top_p=1.0, seed=5, max_tokens=200,
                                           constraint=OutputConstraint("json_object")))
    assert reply.text.startswith("{")
    if reply.stats.finish_reason == "stop":
        assert isinstance(json.loads(reply.text), dict)
    # outside strings no whitespace at all: no runs of spaces or newlines
    assert not re.search(r"\s", _outside_strings(reply.text)), reply.text


def test_regex_lark_and_gbnf(engine):
    cases = [(OutputConstraint("regex", "(ab|cd)+x[0-9]{2}"), lambda t: re.fullmatch("(ab|cd)+x[0-9]{2}", t)),
             (OutputConstraint("lark", 'start: "yes" | "no" | NUM\nNUM: /[0-9]{1,4}/'),
              lambda t: t in ("yes", "no") or re.fullmatch("[0-9]{1,4}", t)),
             (OutputConstraint("gbnf", 'root ::= "the " [a-z]{1,8} "."'), lambda t: re.fullmatch("the [a-z]{1,8}\\.", t))]
    for constraint, ok in cases:
        for sp in (_greedy(constraint, 40), SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                                                           constraint=constraint)):
            reply, _ = _run(engine, sp)
            assert ok(reply.text) and reply.stats.finish_reason == "stop", (constraint.kind, reply.text)


@pytest.mark.parametrize("constraint, named", [
    (schema_of({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (schema_of({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "not"),
    (schema_of({"type": "strin"}), "strin"),
    (schema_of({"type": "string", "format": "no-such-format"}), "no-such-format"),
    (OutputConstraint("json_schema", '{"type": '), "line 1"),
    (OutputConstraint("json_schema", "[1, 2]"), "JSON object"),
    (OutputConstraint("regex", "(ab"), "unclosed group"),
    (OutputConstraint("lark", "start: undefined_rule"), "undefined_rule"),
    (OutputConstraint("gbnf", "root ::= ("), "Expected"),
])
def test_what_cannot_compile_is_refused_naming_it(engine, constraint, named):
    with pytest.raises(GrammarError) as caught:
        engine.grammars.check(constraint)
    assert named in str(caught.value) and caught.value.code == "invalid_grammar"
    assert "\n" not in str(caught.value)
    with pytest.raises(GrammarError):  # before any work: planning refuses it
        plan_sequence(engine, PROMPT, _greedy(constraint))


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_pathological_schema_is_refused_within_the_limit_without_holding_up_others(engine):
    huge_enum = schema_of({"enum": [f"value number {i}" for i in range(150_000)]})
    for constraint in (huge_enum, schema_of(_deep(400)), OutputConstraint("regex", "((a|b){100}){100}x")):
        started = time.perf_counter()
        try:
            engine.grammars.check(constraint)
        except GrammarError:
            pass
        took = time.perf_counter() - started
        assert took < 2.2, took  # the 2 s limit bounds it (a refusal by llguidance's limits comes sooner)
    # A compile past a short limit is refused, abandoned in its thread; another's compile meanwhile goes on.
    grammars = Grammars(engine.tokenizer, engine.grammars.vocab_size, 1 << 20, limit_s=0.05)
    slow = schema_of({"enum": [f"other value {i}" for i in range(60_000)]})
    started = time.perf_counter()
    with pytest.raises(GrammarError, match="not compiled within"):
        grammars.check(slow)
    took = time.perf_counter() - started
    assert took < 0.05 + 0.5, took  # the limit, not the compile's own time
    quick: list[float] = []
    other = threading.Thread(target=lambda: (grammars.check(schema_of(CHOICE)), quick.append(time.perf_counter())))
    t0 = time.perf_counter()
    other.start()
    other.join()
    assert quick, "the second compile was refused"  # within its own 0.05 s, beside the abandoned one
    with pytest.raises(GrammarError, match="not compiled within"):  # remembered: refused at once
        grammars.check(slow)
    assert grammars.compiles == 2 and grammars.timeouts == 1


def test_forced_tokens_are_counted_ride_along_and_change_no_reply(engine):
    for temperature in (0.0, 0.8):
        replies, forwards = {}, {}
        for force in (True, False):
            sp = SamplingParams(temperature=temperature, seed=7, max_tokens=160, constraint=schema_of(PERSON),
                                force_tokens=force, speculate=False)
            replies[force], runner = _run(engine, sp)
            forwards[force] = runner.steps
        on, off = replies[True], replies[False]
        assert on.tokens == off.tokens and on.text == off.text
        assert on.stats.forced_tokens == off.stats.forced_tokens > 8  # the keys and punctuation
        # each run of forced tokens rides in one forward instead of one each
        assert forwards[True] < forwards[False] - 4


def test_drafts_change_no_reply_with_a_grammar(engine, monkeypatch):
    from tests.engine.test_speculative_decoding import Oracle, _FlatCosts

    import justfit.engine.drafting as drafting_module

    real = drafting_module.draft_length
    monkeypatch.setattr(drafting_module, "draft_length", lambda p, a, c: real(p, a, _FlatCosts()))
    constraint = schema_of(NUMBERS)
    plain, _ = _run(engine, _greedy(constraint, speculate=False))
    drafted, _ = _run(engine, _greedy(constraint), drafter=lambda p: Oracle(p, plain.tokens, wrong=3))
    assert drafted.tokens == plain.tokens
    assert drafted.stats.drafted_tokens > 0 and drafted.stats.accepted_tokens > 0
    # a draft the grammar refuses is cut before the verify: nothing invalid is fed
    junk, _ = _run(engine, _greedy(constraint), drafter=lambda p: Oracle(p, [5] * 200, wrong=1000))
    assert junk.tokens == plain.tokens and junk.stats.drafted_tokens == 0


def test_batched_sequences_each_keep_their_own_matcher(engine):
    schemas = [PERSON, CHOICE, NUMBERS, PERSON]
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
    alone = [_run(engine, _greedy(schema_of(s)), prompt=p)[0].tokens for s, p in zip(schemas, prompts)]
    engine.reset()
    runner = Scheduler(engine, max_batch=4, serve=False)
    seqs = [plan_sequence(engine, p, _greedy(schema_of(s))) for s, p in zip(schemas, prompts)]
    got: dict[int, list] = {}
    for seq, chunk in run_all(runner, seqs):
        if chunk is not None:
            got.setdefault(id(seq), []).append(chunk)
    engine.reset()
    for seq, schema, want in zip(seqs, schemas, alone):
        reply = collect(got[id(seq)])
        assert conforms(json.loads(reply.text), schema) and reply.stats.finish_reason == "stop"
        assert reply.tokens == want  # the same greedy reply as alone (row-invariant numerics aside: tiny fp32)


def test_preemption_keeps_the_matcher(engine):
    sp = _greedy(schema_of(PERSON))
    alone, _ = _run(engine, sp)
    engine.reset()
    runner = Scheduler(engine, serve=False)
    seq = plan_sequence(engine, PROMPT, sp)
    runner.admit(seq)
    chunks = []
    while seq.remaining or seq.stats.generated_tokens < 12:
        chunks += [c for _, c in runner.step() if c is not None]
    seq.park()
    assert seq.cache is None
    seq.resume()
    while not seq.finished:
        chunks += [c for _, c in runner.step() if c is not None]
    reply = collect(chunks)
    engine.reset()
    assert seq.stats.preemptions == 1 and reply.tokens == alone.tokens
    assert conforms(json.loads(reply.text), PERSON)


def test_a_sampled_token_follows_the_renormalized_distribution(engine):
    """The first token over many seeds against the model's softmax over the tokens the
    grammar allows (one-sample chi-square, p = 0.001)."""
    constraint = OutputConstraint("regex", "[a-h]")
    allowed = np.flatnonzero(engine.grammars.matcher(constraint).allowed())
    logits = engine.model(mx.array(PROMPT)[None], cache=engine.new_cache())[0, -1].astype(mx.float32)
    temperature = 1.5
    scaled = np.array(logits)[allowed] / temperature
    want = np.exp(scaled - scaled.max())
    want /= want.sum()
    counts = dict.fromkeys(allowed.tolist(), 0)
    draws = 600
    engine.reset()
    for seed in range(draws):
        sp = SamplingParams(temperature=temperature, top_p=1.0, seed=seed, max_tokens=1, constraint=constraint)
        token = next(c.token for c in engine.generate(PROMPT, sp) if c.token is not None)
        counts[token] += 1
    engine.reset()
    got = np.array([counts[t] for t in allowed.tolist()], dtype=float)
    expected = want * draws
    keep = expected >= 5
    table_got = np.append(got[keep], got[~keep].sum())
    table_want = np.append(expected[keep], expected[~keep].sum())
    if table_want[-1] < 5:
        table_got[-2] += table_got[-1]
        table_want[-2] += table_want[-1]
        table_got, table_want = table_got[:-1], table_want[:-1]
    chi2 = float(((table_got - table_want) ** 2 / table_want).sum())
    df = len(table_got) - 1
    assert df >= 2, want  # a test of more than one or two outcomes
    assert chi2 < df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3, (got, expected)


def test_the_token_limit_ends_with_length_and_the_partial_text(engine):
    reply, _ = _run(engine, _greedy(schema_of(PERSON), 7))
    full, _ = _run(engine, _greedy(schema_of(PERSON)))
    assert reply.stats.finish_reason == "length" and reply.stats.generated_tokens == 7
    assert full.text.startswith(reply.text) and reply.text.startswith('{"na')  # the forced keys, cut
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.text)


def test_logprobs_are_the_masked_distributions(engine):
    constraint = schema_of(CHOICE)
    reply, _ = _run(engine, SamplingParams(temperature=0.8, seed=1, max_tokens=40, logprobs=3,
                                           constraint=constraint))
    matcher = engine.grammars.matcher(constraint)
    chunks = [c for c in engine.generate(PROMPT, SamplingParams(temperature=0.8, seed=1, max_tokens=40, logprobs=3,
                                                                constraint=constraint)) if c.token is not None]
    engine.reset()
    assert [c.token for c in chunks] == reply.tokens
    forced = 0
    for c in chunks:
        allowed = matcher.allowed()
        assert allowed[c.token] and c.logprob <= 0.0
        if c.top_logprobs == [(c.token, 0.0)]:  # forced: no choice, probability 1
            forced += 1
        else:  # the masked distribution's: a token the grammar refuses has no mass
            assert all(allowed[t] or lp == -np.inf for t, lp in c.top_logprobs)
            assert np.isfinite(c.logprob)
        matcher.consume(c.token)
    assert forced == reply.stats.forced_tokens > 0


def test_special_tokens_never_inside_constrained_text(engine):
    grammars = engine.grammars
    specials = set(grammars.tokenizer.eos_tokens) | {1}  # <|im_start|> of the tiny vocabulary
    matcher = grammars.matcher(OutputConstraint("regex", "a+"))
    assert not any(matcher.allowed()[t] for t in specials)
    matcher.consume(engine.tokenizer.encode("a")[0])
    allowed = set(np.flatnonzero(matcher.allowed()).tolist())
    assert allowed & specials == set(grammars.tokenizer.eos_tokens) == set(matcher.ends)  # only the ends, once satisfied


def test_the_cache_stays_within_its_bound_and_a_process_budget_sets_it_aside(engine, tiny_llama_dir):
    grammars = Grammars(engine.tokenizer, engine.grammars.vocab_size, 400 * 1024)
    for i in range(12):
        grammars.check(OutputConstraint("regex", f"item{i}-[a-z]{{{i + 1}}}"))
        assert grammars.cached_bytes <= grammars.cache_bytes
    assert 0 < len(grammars._cache) < 12  # the oldest left
    grammars.check(OutputConstraint("regex", "item11-[a-z]{12}"))
    assert grammars.compiles == 12  # the newest found, not compiled again
    # A whole-process budget sets the bound aside from load, less what is held already.
    limited = Engine(str(tiny_llama_dir), config=EngineConfig(budget_bytes=4 << 30, budget_covers_process=True))
    share = limited.budget._share
    assert share.held_back == limited.grammars.bound_bytes >= limited.config.grammar_cache_bytes
    assert share.holding() == 0 and limited.budget.bytes == share.process_budget - share.outside - share.held_back
    limited.grammars.check(schema_of(PERSON))
    held = share.holding()
    assert held == limited.grammars.resident_bytes > 0
    # once held it is in the measured outside share: only the rest is still set aside
    assert share.remeasure() == share.process_budget - share.outside - (share.held_back - held)


def test_smollm2_answers_a_chat_in_valid_json(smollm2_gguf):
    engine = Engine(str(smollm2_gguf))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "capital": {"type": "string", "maxLength": 40},
                                               "population_millions": {"type": "number"}},
              "required": ["name", "capital", "population_millions"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Give the name, capital and population in millions of France as JSON."}]
    replies = [engine.reply(msgs, SamplingParams(temperature=0, max_tokens=80, constraint=schema_of(schema),
                                                 force_tokens=force)) for force in (True, False)]
    for reply in replies:
        assert reply.stats.finish_reason == "stop", reply.text
        assert conforms(json.loads(reply.text), schema), reply.text
    assert replies[0].stats.forced_tokens == replies[1].stats.forced_tokens > 5
    assert "<|im_end|>" not in replies[0].text and replies[0].text == replies[1].text


def test_gemma3_grammar_tokenizer_from_its_pieces(gemma3_gguf):
    """A SentencePiece vocabulary's pieces as llguidance's tokens: spaces, byte pieces,
    control pieces special, its end of turn an end token."""
    from pathlib import Path

    from justfit.engine.grammar import build_tokenizer, end_tokens
    from justfit.model.models import resolve
    from justfit.model.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer(Path(resolve(str(gemma3_gguf))))
    pieces = tokenizer.pieces
    end_of_turn = pieces.token_to_id("<end_of_turn>")
    assert end_of_turn in end_tokens(tokenizer) and set(tokenizer.eos_token_ids) <= set(end_tokens(tokenizer))
    grammar_tokenizer = build_tokenizer(tokenizer, len(tokenizer))
    text = 'Schön {"a": [1, 2.5, "x y"]}\n'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert grammar_tokenizer.decode_str(ids) == text
    assert grammar_tokenizer.decode_bytes([pieces.token_to_id("<0x0A>")]) == b"\n"
    assert grammar_tokenizer.is_special_token(end_of_turn) and not grammar_tokenizer.is_special_token(ids[0])
    assert grammar_tokenizer.tokenize_str(" world") == tokenizer.encode(" world", add_special_tokens=False)

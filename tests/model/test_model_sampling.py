"""The sampling a model recommends (its generation_config.json, the embedded models'
cards, else the documented fallback), and that chat, generate and every server route
use it where a request does not say, while what a request or the command line gives
still wins."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from itertools import islice

import pytest

from cli.chat_session import ChatSession, request_sampling, sampling_text
from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.model.models import CARD_SAMPLING, FALLBACK_SOURCE, describe_sampling, recommended_sampling
from justfit.server.anthropic_request import anthropic_options
from justfit.server.schema import ollama_options, openai_options
from tests.helpers.server_harness import LiveServer, request

GREEDY = SamplingParams(temperature=0)


def folder_with(tmp_path, generation_config) -> object:
    """A model folder holding only a generation_config.json (text as given, or JSON)."""
    text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_generation_config_sampling_with_transformers_defaults_for_the_rest(tmp_path):
    qwen = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    sp, source = recommended_sampling(folder_with(tmp_path, qwen))
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert source == "its generation_config.json"
    # Gemma 3's file names no temperature: transformers samples it at 1.0, so do we.
    sp, _ = recommended_sampling(folder_with(tmp_path, {"top_k": 64, "top_p": 0.95, "bos_token_id": 2}))
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 0.95, 64)
    # A file with no sampling field (SmolLM2's own) is no recommendation: the fallback.
    sp, source = recommended_sampling(folder_with(tmp_path, {"bos_token_id": 1, "eos_token_id": 2}))
    assert (sp, source) == (SamplingParams(), FALLBACK_SOURCE)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", json.dumps({"temperature": -1, "top_p": "high",
                                                                    "top_k": 1.5, "min_p": float("nan")})])
def test_a_bad_generation_config_is_skipped_with_a_warning(tmp_path, caplog, text):
    with caplog.at_level(logging.WARNING, logger="justfit.models"):
        sp, source = recommended_sampling(folder_with(tmp_path, text))
    assert (sp, source) == (SamplingParams(), FALLBACK_SOURCE)
    assert "ignoring" in caplog.text


def test_a_bad_field_does_not_cost_the_good_ones(tmp_path):
    sp, _ = recommended_sampling(folder_with(tmp_path, {"temperature": 0.3, "top_p": 0, "top_k": -4}))
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.3, 1.0, 50)  # the bad two at transformers' defaults


def test_the_embedded_models_take_their_cards(smollm2_gguf, gemma3_gguf, tmp_path):
    for gguf, want in ((smollm2_gguf, (0.2, 0.9, 0)), (gemma3_gguf, (1.0, 0.95, 64))):
        assert gguf.name in CARD_SAMPLING
        sp, source = recommended_sampling(tmp_path, {"justfit": {"source": gguf.name}})
        assert (sp.temperature, sp.top_p, sp.top_k) == want and source == CARD_SAMPLING[gguf.name][1]
    assert SamplingParams().temperature == 0.6 and SamplingParams().top_p == 0.9  # the documented fallback
    assert recommended_sampling(None) == (SamplingParams(), FALLBACK_SOURCE)


def test_describe_sampling():
    assert describe_sampling(SamplingParams(temperature=0.2, top_p=0.9)) == "temperature 0.2, top-p 0.9"
    assert describe_sampling(SamplingParams(temperature=1.0, top_p=0.95, top_k=64)) == \
        "temperature 1, top-p 0.95, top-k 64"
    assert describe_sampling(SamplingParams(temperature=0, top_k=5)) == "greedy (temperature 0)"


def test_requests_take_the_defaults_and_override_them():
    model = SamplingParams(temperature=0.2, top_p=0.9, top_k=64, min_p=0.05, repetition_penalty=1.1)
    for opts in (openai_options({}, 32, defaults=model), openai_options({}, 32, False, model),
                 ollama_options({}, 32, model), anthropic_options({"max_tokens": 32}, model)):
        sp = opts.sampling
        assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.max_tokens) == \
            (0.2, 0.9, 64, 0.05, 1.1, 32)
    given = openai_options({"temperature": 1.3, "top_k": 0}, 32, defaults=model).sampling
    assert (given.temperature, given.top_p, given.top_k) == (1.3, 0.9, 0)  # what the request says wins
    given = ollama_options({"options": {"top_p": 0.5}}, 32, model).sampling
    assert (given.temperature, given.top_p) == (0.2, 0.5)
    given = anthropic_options({"max_tokens": 8, "temperature": 0}, model).sampling
    assert (given.temperature, given.top_k) == (0, 64)


@pytest.fixture(scope="module")
def greedy_model(tiny_llama_dir, tmp_path_factory):
    """The tiny llama, recommending greedy decoding in its generation_config.json: a
    default any request that does not say visibly follows (the same tokens every time)."""
    folder = tmp_path_factory.mktemp("greedy") / "llama"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    # context 1024: SamplingParams' default 512-token reply fits beside a prompt (trained: 512)
    return Engine(str(folder), config=EngineConfig(context_limit=1024))


def test_the_engine_exposes_and_uses_the_models_default(greedy_model, tiny_llama_dir):
    engine = greedy_model
    assert engine.default_sampling == replace(GREEDY, top_p=1.0, top_k=50)  # the rest at transformers' defaults
    assert engine.sampling_source == "its generation_config.json"
    plain = Engine(str(tiny_llama_dir))  # no generation_config.json, no card: the fallback
    assert plain.default_sampling == SamplingParams() and plain.sampling_source == FALLBACK_SOURCE
    prompt = "the cat sat on"
    want = [c.token for c in engine.generate(prompt, replace(GREEDY, max_tokens=12, ignore_eos=True))]
    engine.reset()
    gen = engine.generate(prompt, None)  # no sampling given: the model's, greedy
    got = [c.token for c in islice(gen, 12)]
    gen.close()
    assert got == want[:len(got)] and len(got) == 12


def test_every_route_samples_the_models_default(greedy_model):
    engine = greedy_model
    want = engine.tokenizer.decode([c.token for c in engine.generate(
        "the cat sat on", replace(GREEDY, max_tokens=10, ignore_eos=True)) if c.token is not None])
    engine.reset()
    live = LiveServer(engine)
    try:
        texts = set()
        for _ in range(2):  # different each time if it sampled at a temperature
            body = {"prompt": "the cat sat on", "max_tokens": 10, "ignore_eos": True}
            texts.add(json.loads(request(live, "POST", "/v1/completions", body)[2])["choices"][0]["text"])
            ollama = {"prompt": "the cat sat on", "raw": True, "stream": False, "options": {"num_predict": 10}}
            status, _, text = request(live, "POST", "/api/generate", ollama)
            assert status == 200, text
        assert texts == {want}
        chat = [{"role": "user", "content": "hello there"}]
        answers = {json.loads(request(live, "POST", "/v1/chat/completions", {"messages": chat, "max_tokens": 8})[2])
                   ["choices"][0]["message"]["content"] for _ in range(2)}
        anthropic = {json.loads(request(live, "POST", "/v1/messages", {"messages": chat, "max_tokens": 8})[2])
                     ["content"][0]["text"] for _ in range(2)}
        assert len(answers) == 1 and answers == anthropic  # greedy on both, the same template
    finally:
        live.close()


def test_the_command_line_overrides_and_the_banner_says_so(greedy_model):
    engine = greedy_model
    sp = request_sampling(engine, 64, 7)
    assert sp == replace(engine.default_sampling, max_tokens=64, seed=7)
    assert sampling_text(engine, sp) == "greedy (temperature 0) (its generation_config.json)"
    given = request_sampling(engine, 64, 7, temperature=0.9, top_p=0.5)
    assert (given.temperature, given.top_p, given.max_tokens, given.seed) == (0.9, 0.5, 64, 7)
    assert sampling_text(engine, given) == "temperature 0.9, top-p 0.5, top-k 50 (given)"  # top-k still the model's
    import io

    session = ChatSession(engine, [], io.StringIO())
    assert session.sampling == engine.default_sampling  # none given: the model's
    assert "sampling: greedy (temperature 0) (its generation_config.json)" in session.stats_text()

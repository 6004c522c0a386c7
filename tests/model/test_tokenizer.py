"""Tokenizers built from GGUF metadata: tiny vocabularies of both styles, and the
real models' tokenizers on a whole document."""

import os
import sys

import pytest
from transformers import PreTrainedTokenizerFast

from justfit.model.gguf.tokenizer import UnsupportedTokenizer, build_tokenizer, tokenizer_config
from justfit.model.models import load
from tests.helpers.tiny_models import gpt2_vocab, spm_vocab


def _meta(v: dict, **extra) -> dict:
    meta = {"tokenizer.ggml.model": v["model"], "tokenizer.ggml.pre": v["pre"],
            "tokenizer.ggml.tokens": v["tokens"], "tokenizer.ggml.token_type": [int(t) for t in v["types"]],
            "tokenizer.ggml.bos_token_id": v["bos"], "tokenizer.ggml.eos_token_id": v["eos"],
            "tokenizer.ggml.add_bos_token": v["add_bos"]}
    if "merges" in v:
        meta["tokenizer.ggml.merges"] = v["merges"]
    if "scores" in v:
        meta["tokenizer.ggml.scores"] = v["scores"]
        meta["tokenizer.ggml.unknown_token_id"] = v["unk"]
    meta.update(extra)
    return meta


def test_gpt2_style_merges_specials_and_round_trip():
    v = gpt2_vocab()
    tok = build_tokenizer(_meta(v))
    ids = tok.encode("<|im_start|>the cat").ids
    assert ids[0] == v["tokens"].index("<|im_start|>")
    assert v["tokens"].index("Ġthe") in tok.encode(" the").ids  # merges applied
    text = "héllo wörld, the end ✓"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: any text round-trips


def test_spm_style_scores_byte_fallback_and_bos():
    v = spm_vocab()
    tok = build_tokenizer(_meta(v, **{"tokenizer.ggml.add_space_prefix": False}))  # as Gemma 3
    ids = tok.encode("the\nthe").ids
    assert ids[0] == v["bos"]  # add_bos_token
    # "the" -> "▁the" is not produced without a space prefix; "\n" is a user-defined piece
    assert v["tokens"].index("\n") in ids
    assert v["tokens"].index("\u2581the") in tok.encode(" the").ids  # best-scoring merges win
    accented = tok.encode("é").ids[1:]
    assert [v["tokens"][i] for i in accented] == ["<0xC3>", "<0xA9>"]  # byte fallback
    assert tok.decode(tok.encode(" the é").ids, skip_special_tokens=True) == " the é"
    # llama.cpp's default for SentencePiece vocabularies: a space is prepended
    prefixed = build_tokenizer(_meta(v))
    assert prefixed.encode("the").ids[1] == v["tokens"].index("\u2581the")
    assert prefixed.decode(prefixed.encode("the").ids, skip_special_tokens=True) == "the"


def test_tokenizer_config_carries_specials_and_template():
    v = gpt2_vocab()
    cfg = tokenizer_config(_meta(v, **{"tokenizer.chat_template": "{{ x }}"}))
    assert cfg["eos_token"] == "<|im_end|>" and cfg["chat_template"] == "{{ x }}"
    assert cfg["add_bos_token"] is False


def test_unknown_pre_tokenizer_is_refused():
    with pytest.raises(UnsupportedTokenizer, match="pre-tokenizer"):
        build_tokenizer(_meta(gpt2_vocab(), **{"tokenizer.ggml.pre": "made-up"}))


def test_saved_tokenizer_loads_in_transformers(tmp_path):
    tok = build_tokenizer(_meta(gpt2_vocab()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert hf.decode(hf.encode("the end")) == "the end"


LICENSE = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "LICENSE.txt")


@pytest.mark.parametrize("name", ["smollm2_gguf", "gemma3_gguf"])
def test_real_tokenizers_round_trip_a_document(name, request):
    if not os.path.exists(LICENSE):
        pytest.skip("no LICENSE.txt to tokenize")
    tokenizer = load(str(request.getfixturevalue(name))).tokenizer
    text = open(LICENSE, encoding="utf-8").read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert 2000 < len(ids) < 6000
    assert tokenizer.decode(ids) == text


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again, é 🚀"}]
TEXTS = ["Hello world", " leading space", "émojis 🚀🦀 and 中文\n\n  tabs\t", "<|im_start|>user\nhi<|im_end|>",
         "<bos>x<eos> 12345 + 678"]


@pytest.mark.parametrize("name", ["smollm2_gguf", "gemma3_gguf"])
def test_converted_models_load_without_transformers_as_mlx_lm_loads_them(name, request):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load as mlx_lm_load

    from justfit.model.chat_template import FALLBACK_TEMPLATE
    from justfit.model.models import resolve
    from justfit.model.tokenizer import GGUFTokenizer

    ours = load(str(request.getfixturevalue(name)))
    model, theirs, _ = mlx_lm_load(str(resolve(str(request.getfixturevalue(name)))), return_config=True)
    assert isinstance(ours.tokenizer, GGUFTokenizer)
    mine, stock = dict(tree_flatten(ours.model.parameters())), dict(tree_flatten(model.parameters()))
    assert mine.keys() == stock.keys()
    assert all(mine[k].dtype == stock[k].dtype and mx.array_equal(mine[k], stock[k]).item() for k in mine)
    tok = ours.tokenizer
    assert (tok.eos_token_ids, tok.bos_token_id, len(tok.vocab)) == \
        (theirs.eos_token_ids, theirs.bos_token_id, len(theirs.vocab))
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        ids = tok.encode(text)
        assert tok.decode(ids) == theirs.decode(ids)
        stream, shown = tok.detokenizer, ""
        for i in ids:  # streamed a token at a time, the text is the whole decode's
            stream.add_token(i)
            shown += stream.last_segment
        stream.finalize()
        assert shown + stream.last_segment == tok.decode(ids)
    for template in filter(None, (tok.chat_template, FALLBACK_TEMPLATE)):
        rendered = theirs.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True)
        assert tok.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True) == \
            list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)


def test_a_character_split_across_tokens_streams_whole(smollm2_gguf):
    tok = load(str(smollm2_gguf)).tokenizer
    ids = tok.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces
    stream = tok.detokenizer
    pieces = []
    for i in ids:
        stream.add_token(i)
        pieces.append(stream.last_segment)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🦀"
    stream.reset()
    stream.add_token(ids[0])  # the reply ends inside the character: finalize lets out what there is
    stream.finalize()
    assert stream.last_segment == tok.decode(ids[:1])


def test_a_template_cannot_reach_python_internals(smollm2_gguf):
    from jinja2.exceptions import SecurityError

    tok = load(str(smollm2_gguf)).tokenizer
    with pytest.raises(SecurityError):
        tok.apply_chat_template(MESSAGES, chat_template="{{ messages.__class__.__mro__ }}", tokenize=False)
    with pytest.raises(Exception, match="no tools here"):
        tok.apply_chat_template(MESSAGES, chat_template="{{ raise_exception('no tools here') }}", tokenize=False)

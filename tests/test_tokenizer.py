"""Tokenizers built from GGUF metadata: tiny vocabularies of both styles, and the
real models' tokenizers on a whole document."""

import os
import sys

import pytest
from transformers import PreTrainedTokenizerFast

from justfit.gguf.tokenizer import UnsupportedTokenizer, build_tokenizer, tokenizer_config
from justfit.models import load
from tests.tiny_models import gpt2_vocab, spm_vocab


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

"""The array-held byte-level BPE tokenizer gives the same ids and text as the `tokenizers`
one built from the same GGUF vocabulary (tiny vocabularies with every pre-tokenizer, and
SmolLM2's in full), holds a fraction of its memory, and refuses a damaged file clearly."""

import random

import numpy as np
import pytest

from justfit.model.bytelevel import FILE_NAME, PRE_TOKENIZERS, ByteLevelBPE, write_vocabulary
from justfit.model.gguf.tokenizer import build_tokenizer
from justfit.model.vocabulary import BadVocabulary
from justfit.server.prompt_bytes import longest_token_bytes
from tests.model.test_tokenizer import _meta
from tests.helpers.tiny_models import gpt2_vocab
from tests.helpers.vocabulary_checks import converted_vocabulary, same_as_library, sample_texts

ALPHABET = list("abcdefghijklmnopqrstuvwxyz  \n\t\r'é中🚀<>/0123456789٣²Ⅷ_-.,!") + \
    ["the", " the", "in", "er", "\n\n", "'s", "'LL", "<|im_start|>", "  ", "123"]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 60))) for _ in range(count)]


@pytest.mark.parametrize("pre", ["default", "smollm", "llama3", "qwen2"])
@pytest.mark.parametrize("add_bos", [False, True])
def test_same_ids_and_text_as_the_tokenizers_library(tmp_path, pre, add_bos):
    v = gpt2_vocab()
    meta = _meta(v, **{"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": add_bos})
    write_vocabulary(tmp_path / FILE_NAME, meta)
    ours, theirs = ByteLevelBPE(tmp_path / FILE_NAME), build_tokenizer(meta)
    fixed = ["", " ", "the", " the cat", "  5  x\n\n\n  y", "it's I'LL 'd", "<|im_start|>the<|im_end|>x",
             "x²³ Ⅷ ٣ 一", "é 🚀 中", "a\r\n\r\nb"]
    same_as_library(ours, theirs, fixed + _texts(11, 300))
    assert ours.longest_token_bytes() == longest_token_bytes(theirs)  # the server's size bound, unchanged
    assert ours.token_to_id("Ġthe") == v["tokens"].index("Ġthe") and ours.token_to_id("zzz") is None
    assert len(ours) == len(v["tokens"]) and ours.get_vocab()["he"] == v["tokens"].index("he")


def test_ids_outside_the_vocabulary_are_dropped_and_bad_bytes_replaced(tmp_path):
    v = gpt2_vocab()
    meta = _meta(v)
    write_vocabulary(tmp_path / FILE_NAME, meta)
    ours, theirs = ByteLevelBPE(tmp_path / FILE_NAME), build_tokenizer(meta)
    rng = random.Random(5)
    for _ in range(300):  # random ids: unfinished and invalid UTF-8 among them
        ids = [rng.randrange(len(v["tokens"])) for _ in range(rng.randrange(1, 10))]
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    assert ours.decode([-1, 10**9] + ours.encode("hé")) == "hé"


def test_an_unknown_pre_tokenizer_is_refused_when_converting(tmp_path):
    with pytest.raises(ValueError, match="pre-tokenizer"):
        write_vocabulary(tmp_path / FILE_NAME, _meta(gpt2_vocab(), **{"tokenizer.ggml.pre": "nonesuch"}))
    assert "nonesuch" not in PRE_TOKENIZERS


def test_a_damaged_vocabulary_file_is_refused_clearly(tmp_path):
    path = tmp_path / FILE_NAME
    write_vocabulary(path, _meta(gpt2_vocab()))
    good = dict(np.load(path))
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(BadVocabulary, match="delete its folder"):
        ByteLevelBPE(path)
    for damage in ({"merges": np.array([[0, 10**6]], np.int32)},  # a merge of a piece past the vocabulary
                   {"pre": np.frombuffer(b"nonesuch", np.uint8)}, {"flags": np.zeros(3, np.int64)}):
        with open(path, "wb") as f:
            np.savez(f, **{**good, **damage})
        with pytest.raises(BadVocabulary, match="do not describe"):
            ByteLevelBPE(path)


def test_smollm2_vocabulary_matches_the_library_in_a_fraction_of_the_memory(smollm2_gguf):
    from justfit.model.tokenizer import GGUFTokenizer

    # the library holds ~14 MiB for this vocabulary
    ours, theirs, folder = converted_vocabulary(ByteLevelBPE, smollm2_gguf, FILE_NAME, 6, 16)
    source = open(__file__, encoding="utf-8").read() + open(build_tokenizer.__code__.co_filename).read()
    texts = sample_texts(source, 3, ["<|im_start|>user\nhi 123 4567<|im_end|>\n", "  5  x\n\n\n  y", "it's I'LL 'd"],
                         lambda rng: chr(rng.choice([rng.randrange(0, 0xD800), rng.randrange(0xE000, 0x110000)])))
    rng = random.Random(4)
    same_as_library(ours, theirs, texts)
    for _ in range(200):
        ids = [rng.randrange(len(ours)) for _ in range(rng.randrange(1, 12))]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), ids
    assert isinstance(GGUFTokenizer(folder)._tokenizer, ByteLevelBPE)  # what a converted SmolLM2 loads
    assert longest_token_bytes(GGUFTokenizer(folder)) == longest_token_bytes(theirs) > 4


def test_piece_bytes_rebuild_text(tmp_path):
    """Each piece's bytes, through GPT-2's byte alphabet (what a grammar matches tokens
    against: justfit.engine.grammar), joined give the text; control pieces are marked."""
    write_vocabulary(tmp_path / FILE_NAME, _meta(gpt2_vocab()))
    tok = ByteLevelBPE(tmp_path / FILE_NAME)
    for text in ["the cat", " in\n\n a tree", "é 🚀 中", "<|im_start|>x"]:
        ids = tok.encode_fragment(text)
        assert b"".join(tok.piece_bytes(i) for i in ids) == text.encode()
    assert tok.is_control(tok.token_to_id("<|im_end|>")) and not tok.is_control(tok.token_to_id("Ġthe"))

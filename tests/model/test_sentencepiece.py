"""The array-held SentencePiece tokenizer gives the same ids and text as the `tokenizers`
one built from the same GGUF vocabulary (tiny vocabularies, and Gemma 3's in full),
holds a fraction of its memory, and refuses a damaged vocabulary file clearly."""

import os
import random
import sys

import numpy as np
import pytest

from justfit.model.gguf.tokenizer import build_tokenizer
from justfit.model.sentencepiece import FILE_NAME, SentencePieceBPE, write_vocabulary
from justfit.model.vocabulary import NORMAL, BadVocabulary
from justfit.server.prompt_bytes import longest_token_bytes
from tests.model.test_tokenizer import _meta
from tests.helpers.tiny_models import spm_vocab
from tests.helpers.vocabulary_checks import converted_vocabulary, same_as_library, sample_texts

ALPHABET = list("abcdefghijklmnopqrstuvwxyz  \n\t\u2581é中🚀<>/") + ["the", " the", "in", "er", "\n\n"]


def _texts(seed: int, count: int, pieces: list[str]) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60))) for _ in range(count)]


def _bridged_vocab() -> dict:
    """The tiny vocabulary plus a piece that spans a word start ("a▁b", as Gemma's ">▁</")."""
    v = spm_vocab()
    for piece, score in (("a\u2581", -40.0), ("a\u2581b", -41.0), ("\u2581\u2581", -42.0)):
        v["tokens"].append(piece)
        v["types"].append(NORMAL)
        v["scores"].append(score)
    return v


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("vocab", [spm_vocab, _bridged_vocab])
def test_same_ids_and_text_as_the_tokenizers_library(tmp_path, prefix, vocab):
    meta = _meta(vocab(), **{"tokenizer.ggml.add_space_prefix": prefix})
    write_vocabulary(tmp_path / FILE_NAME, meta)
    ours, theirs = SentencePieceBPE(tmp_path / FILE_NAME), build_tokenizer(meta)
    fixed = ["", " ", "the", " the cat", "a b", "aa bb", "a  b", "<bos>the<eos>x", "\n\nthe\n", "é 🚀 中"]
    same_as_library(ours, theirs, fixed + _texts(7, 300, ALPHABET))
    assert ours.longest_token_bytes() == longest_token_bytes(theirs)  # the server's size bound, unchanged
    assert ours.encode("a b", False) == ours.encode("a b", False)  # remembered parts give the same ids


def test_ids_outside_the_vocabulary_are_dropped_and_bad_bytes_replaced(tmp_path):
    v = spm_vocab()
    write_vocabulary(tmp_path / FILE_NAME, _meta(v))
    tok = SentencePieceBPE(tmp_path / FILE_NAME)
    byte = v["tokens"].index("<0xC3>")
    assert tok.decode([-1, 10**9, byte, byte + 1]) == tok.decode([byte, byte + 1])
    assert tok.decode([byte, v["tokens"].index("a")]) == "\ufffda"  # an unfinished character
    assert tok.token_to_id("\u2581the") == v["tokens"].index("\u2581the") and tok.token_to_id("zzz") is None
    assert len(tok) == len(v["tokens"]) and tok.get_vocab()["he"] == v["tokens"].index("he")


def test_a_damaged_vocabulary_file_is_refused_clearly(tmp_path):
    path = tmp_path / FILE_NAME
    write_vocabulary(path, _meta(spm_vocab()))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadVocabulary, match="delete its folder"):
        SentencePieceBPE(path)
    with open(path, "wb") as f:  # readable, but the offsets run past the pieces
        np.savez(f, pieces=np.zeros(3, np.uint8), offsets=np.array([0, 5]), scores=np.zeros(1, np.float32),
                 types=np.ones(1, np.uint8), flags=np.zeros(4, np.int64))
    with pytest.raises(BadVocabulary, match="do not describe"):
        SentencePieceBPE(path)
    with open(path, "wb") as f:
        np.savez(f, pieces=np.array([0xFF], np.uint8), offsets=np.array([0, 1]), scores=np.zeros(1, np.float32),
                 types=np.ones(1, np.uint8), flags=np.zeros(4, np.int64))
    with pytest.raises(BadVocabulary, match="not UTF-8"):
        SentencePieceBPE(path)


LICENSE = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "LICENSE.txt")


def test_gemma3_vocabulary_matches_the_library_in_a_tenth_of_the_memory(gemma3_gguf):
    from justfit.model.tokenizer import GGUFTokenizer

    # the library holds ~96 MiB for this vocabulary
    ours, theirs, folder = converted_vocabulary(SentencePieceBPE, gemma3_gguf, FILE_NAME, 16, 24)
    source = open(__file__, encoding="utf-8").read()
    if os.path.exists(LICENSE):
        source += open(LICENSE, encoding="utf-8").read()
    texts = sample_texts(source, 3, ["<start_of_turn>user\nhi<end_of_turn>\n", "a > </b>  <div> </div>",
                                     "\u2581\u2581x \u2581"], lambda rng: chr(rng.randrange(32, 0x3000)))
    same_as_library(ours, theirs, texts)
    assert isinstance(GGUFTokenizer(folder)._tokenizer, SentencePieceBPE)  # what a converted Gemma loads
    assert longest_token_bytes(GGUFTokenizer(folder)) == longest_token_bytes(theirs) > 4


@pytest.mark.parametrize("prefix", [False, True])
def test_piece_bytes_and_fragments_rebuild_text(tmp_path, prefix):
    """What a grammar matches tokens against (justfit.engine.grammar): each piece's bytes
    (a byte piece its byte, U+2581 a space) joined give the text; a fragment's ids carry
    no prefix space, whatever the vocabulary asks of a whole text."""
    write_vocabulary(tmp_path / FILE_NAME, _meta(spm_vocab(), **{"tokenizer.ggml.add_space_prefix": prefix}))
    tok = SentencePieceBPE(tmp_path / FILE_NAME)
    for text in ["the cat", " in a tree", "é 🚀 中\n", "x"]:
        ids = tok.encode_fragment(text)
        assert b"".join(tok.piece_bytes(i) for i in ids) == text.encode()
    assert tok.is_control(tok.token_to_id("<eos>")) and not tok.is_control(tok.token_to_id("he"))

"""Checks shared by the tests of JustFit's array-held tokenizers: the same ids and text
as the `tokenizers` library, and a converted model's vocabulary loaded in a bounded
amount of memory."""

import random
import tracemalloc
from pathlib import Path


def same_as_library(ours, theirs, texts: list[str]) -> None:
    """`ours` encodes and decodes each text as `theirs` (a `tokenizers.Tokenizer`) does,
    with and without special tokens."""
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special).ids, text
        ids = theirs.encode(text).ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), text


def converted_vocabulary(kind, gguf: Path, file_name: str, held_mib: int, peak_mib: int):
    """(ours, the library's tokenizer, the folder) for a real GGUF, converted: the
    converter wrote `file_name`, and loading it as `kind` held under `held_mib` and
    peaked under `peak_mib` (tracemalloc)."""
    from tokenizers import Tokenizer

    from justfit.model.models import resolve

    folder = resolve(str(gguf))
    assert (folder / file_name).exists()  # the converter wrote it
    tracemalloc.start()
    ours = kind(folder / file_name)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert held < held_mib << 20 and peak < peak_mib << 20
    return ours, Tokenizer.from_file(str(folder / "tokenizer.json")), folder


def sample_texts(source: str, seed: int, fixed: list[str], random_chars) -> list[str]:
    """`fixed`, `source` whole, 100 slices of it and 40 strings of `random_chars(rng)`."""
    rng = random.Random(seed)
    texts = [source, *fixed]
    texts += [source[i:i + rng.randrange(1, 300)] for i in rng.sample(range(len(source)), 100)]
    texts += ["".join(random_chars(rng) for _ in range(150)) for _ in range(40)]
    return texts

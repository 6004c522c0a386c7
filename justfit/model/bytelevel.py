"""A byte-level BPE tokenizer (GGUF's `gpt2` vocabularies: SmolLM2's, Llama 3's, Qwen's)
held in flat arrays instead of per-piece objects.

The `tokenizers` library keeps such a vocabulary as hash maps of strings and merges,
about 14 MiB resident for SmolLM2's 49,152 pieces (and its library's code mapped beside);
here the pieces are justfit.model.vocabulary's arrays and the merges one array of
(left id, right id) pairs in rank order, found through an open-addressing table keyed by
the pair.

The encoding is the one justfit.model.gguf.tokenizer builds for `tokenizers` (and
llama.cpp checks): control and user-defined pieces are matched verbatim in the raw text
first; the text between them is split by the vocabulary's pre-tokenizer regex (named by
GGUF's `tokenizer.ggml.pre`; SmolLM's first isolates every digit), each piece's UTF-8
bytes are mapped to GPT-2's printable byte alphabet, and its characters are merged
pairwise, the lowest-ranked merge first, ties by position. Decoding maps the alphabet
back to bytes (a piece with characters outside it gives its own UTF-8) and replaces
bytes that are not UTF-8 as the library does.
"""

from __future__ import annotations

import heapq
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from justfit.model.vocabulary import CONTROL, StoredVocabulary, piece_arrays

FILE_NAME = "tokenizer.bpe.npz"
_REMEMBERED_WORDS = 16384

# The pre-tokenizers' regexes (the `regex` module's syntax, as the library's)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> (regex, digits isolated first)
PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "starcoder", "refact"), (GPT2_SPLIT, False)),
    "smollm": (GPT2_SPLIT, True),
    **dict.fromkeys(("llama-bpe", "llama3", "falcon3", "smaug-bpe"), (LLAMA3_SPLIT, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "qwen35"), (QWEN2_SPLIT, False)),
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the others for U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_vocabulary(path: Path, meta: dict[str, Any]) -> None:
    """Store a GGUF `gpt2` vocabulary (pieces, types, merges by rank, BOS, pre-tokenizer) at `path`."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    first = {}
    for i, t in enumerate(meta["tokenizer.ggml.tokens"]):
        first.setdefault(t, i)
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        left, _, right = m.partition(" ")
        merges.append((first[left], first[right]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    flags = [int(bool(meta.get("tokenizer.ggml.add_bos_token", False))), -1 if bos is None else int(bos)]
    with open(path, "wb") as f:
        np.savez(f, **piece_arrays(meta), merges=np.asarray(merges, np.int32).reshape(-1, 2), flags=np.asarray(flags, np.int64),
                 pre=np.frombuffer(pre.encode(), np.uint8))


class ByteLevelBPE(StoredVocabulary):
    """The tokenizer of one stored byte-level vocabulary (see the module doc)."""

    def __init__(self, path: Path):
        super().__init__(path)
        import regex  # the pre-tokenizers' \p{L} and \p{N}; only byte-level vocabularies need it

        pattern, digits = PRE_TOKENIZERS[self.pre]
        self._split = regex.compile(pattern)
        self._digits = regex.compile(r"\p{N}") if digits else None
        self._byte_char = _byte_alphabet()
        self._char_byte = {c: b for b, c in enumerate(self._byte_char)}
        self._index_merges()
        self._word = lru_cache(maxsize=_REMEMBERED_WORDS)(self._merge)

    def _read(self, arrays: dict[str, np.ndarray], n: int) -> bool:
        merges, flags, pre = arrays.get("merges"), arrays.get("flags"), arrays.get("pre")
        if (merges is None or flags is None or pre is None or merges.ndim != 2 or merges.shape[1] != 2
                or flags.shape != (2,) or (merges.size and (merges.min() < 0 or merges.max() >= n))):
            return False
        try:
            self.pre = pre.tobytes().decode()
        except UnicodeDecodeError:
            return False
        if self.pre not in PRE_TOKENIZERS:
            return False
        self._merges = merges.astype(np.int32)
        self.add_bos = bool(flags[0])
        self.bos_id = int(flags[1]) if 0 <= flags[1] < n else None
        return True

    def _index_merges(self) -> None:
        """Pair (left, right) -> (rank, merged id), an open-addressing table of arrays."""
        count = len(self._merges)
        slots = 1 << max(4, (count * 4 // 3).bit_length())
        self._merge_mask = slots - 1
        self._merge_key = array("q", [-1]) * slots
        self._merge_rank = array("i", [0]) * slots
        self._merge_id = array("i", [0]) * slots
        n = self._size
        for rank, (left, right) in enumerate(self._merges.tolist()):
            merged = self.token_to_id(self.piece(left) + self.piece(right))
            if merged is None:
                continue  # the library refuses such a vocabulary; its converter never writes one
            key = left * n + right
            j = hash((left, right)) & self._merge_mask  # the key itself would cluster (n is a multiple of 2**k)
            while self._merge_key[j] >= 0:
                if self._merge_key[j] == key:
                    break  # a repeated merge keeps its first rank
                j = (j + 1) & self._merge_mask
            else:
                self._merge_key[j], self._merge_rank[j], self._merge_id[j] = key, rank, merged
        del self._merges  # what merging needs is in the table now

    def _keeps_text(self) -> bool:
        # As the library's check: no unknown token swallows text. A byte with no piece is
        # dropped (SmolLM2 has none for the bytes UTF-8 never uses and six control characters),
        # so a prompt made of those could be refused by size though it encodes to little.
        return True

    def _text_bytes(self, piece: str) -> int:
        chars = self._char_byte
        return len(piece) if all(c in chars for c in piece) else len(piece.encode("utf-8"))  # a byte a character

    def piece_bytes(self, token: int) -> bytes:
        """The bytes piece `token` stands for: its characters mapped back through GPT-2's
        byte alphabet (a piece with characters outside it, its own UTF-8)."""
        piece, chars = self.piece(token), self._char_byte
        return bytes(chars[c] for c in piece) if all(c in chars for c in piece) else piece.encode("utf-8")

    def _pair(self, left: int, right: int) -> tuple[int, int] | None:
        """(rank, merged id) of the merge of `left` then `right`, if any."""
        key = left * self._size + right
        j = hash((left, right)) & self._merge_mask
        while (k := self._merge_key[j]) >= 0:
            if k == key:
                return self._merge_rank[j], self._merge_id[j]
            j = (j + 1) & self._merge_mask
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens`: the BOS the vocabulary asks for."""
        ids = [self.bos_id] if add_special_tokens and self.add_bos and self.bos_id is not None else []
        for part, token in self._verbatim_split(text):
            if token is not None:
                ids.append(token)
                continue
            for piece in self._pieces(part):
                ids += self._word(piece)
        return ids

    def _pieces(self, text: str) -> list[str]:
        """`text` cut by the pre-tokenizer: every match, and any text between them."""
        parts = [text]
        if self._digits is not None:
            parts = _isolated(self._digits, text)
        out = []
        for part in parts:
            out += _isolated(self._split, part)
        return out

    def _merge(self, piece: str) -> tuple[int, ...]:
        """Ids of one pre-tokenized piece: its bytes in the byte alphabet, merged lowest rank first."""
        symbols = [t for t in (self.token_to_id(self._byte_char[b]) for b in piece.encode("utf-8")) if t is not None]
        count = len(symbols)
        after = list(range(1, count + 1))
        before = list(range(-1, count - 1))
        heap: list = []

        def push(i: int, j: int) -> None:
            found = self._pair(symbols[i], symbols[j])
            if found is not None:
                heapq.heappush(heap, (found[0], i, symbols[i], symbols[j], found[1]))

        for i in range(count - 1):
            push(i, i + 1)
        while heap:
            _, i, left, right, merged = heapq.heappop(heap)
            j = after[i]
            if symbols[i] != left or j >= count or symbols[j] != right:
                continue  # a stale pair: one side merged since
            symbols[i], symbols[j] = merged, None
            after[i] = after[j]
            if after[j] < count:
                before[after[j]] = i
            if before[i] >= 0:
                push(before[i], i)
            if after[i] < count:
                push(i, after[i])
        return tuple(s for s in symbols if s is not None)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (ids outside the vocabulary are dropped; bytes that are not
        UTF-8 become U+FFFD, as the library's decoder does)."""
        data = bytearray()
        for token in ids:
            if not 0 <= token < self._size or (skip_special_tokens and self._types[token] == CONTROL):
                continue
            piece = self.piece(token)
            try:
                data += bytes(self._char_byte[c] for c in piece)
            except KeyError:
                data += piece.encode("utf-8")
        return data.decode("utf-8", errors="replace")


def _isolated(pattern, text: str) -> list[str]:
    """`text` cut into `pattern`'s matches and the text between them, in order."""
    out, at = [], 0
    for m in pattern.finditer(text):
        if m.start() > at:
            out.append(text[at:m.start()])
        if m.end() > m.start():
            out.append(m.group())
        at = m.end()
    if at < len(text):
        out.append(text[at:])
    return out

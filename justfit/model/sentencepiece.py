"""A SentencePiece-style BPE tokenizer (GGUF's `llama` vocabularies, Gemma's among them)
held in a few flat arrays instead of per-piece objects.

The `tokenizers` library keeps such a vocabulary as two hash maps of strings plus a map
of every implied merge: about 96 MiB resident for Gemma 3's 262,144 pieces. Here the
pieces are one UTF-8 byte string with offsets, their scores and types two arrays, and a
piece is found through an open-addressing table of its hash (about 10 MiB in all); the
merges are not stored, they follow from the scores.

The encoding is the one justfit.model.gguf.tokenizer builds for `tokenizers` (and llama.cpp
checks): control and user-defined pieces are matched verbatim in the raw text first
(leftmost, longest); each stretch between them has its spaces replaced by U+2581 (a
prefix added when the vocabulary asks for one), then starts as one symbol a character
(a character with no piece becomes its UTF-8 byte pieces) and repeatedly merges the
adjacent pair whose joined text is a normal piece, best score first, ties by the pair's
ids then by position. Merges never join a piece across a point where U+2581 follows
another character unless some piece spans such a point, so a stretch is cut there and
its parts (mostly words) are encoded once each and remembered.
"""

from __future__ import annotations

import heapq
import re
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from justfit.model.vocabulary import BYTE, CONTROL, NORMAL, StoredVocabulary, piece_arrays

SPACE = "\u2581"
FILE_NAME = "tokenizer.spm.npz"
_WORD_START = re.compile(f"(?<=[^{SPACE}])(?={SPACE})")  # where U+2581 follows another character
_REMEMBERED_PARTS = 16384


def write_vocabulary(path: Path, meta: dict[str, Any]) -> None:
    """Store a GGUF `llama` vocabulary (its pieces, scores, types and flags) at `path`."""
    def token_id(key: str) -> int:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return -1 if value is None else int(value)

    flags = [int(bool(meta.get("tokenizer.ggml.add_space_prefix", True))),
             int(bool(meta.get("tokenizer.ggml.add_bos_token", False))), token_id("bos"), token_id("unknown")]
    with open(path, "wb") as f:
        np.savez(f, **piece_arrays(meta), scores=np.asarray(meta["tokenizer.ggml.scores"], np.float32),
                 flags=np.asarray(flags, np.int64))


class SentencePieceBPE(StoredVocabulary):
    """The tokenizer of one stored vocabulary (see the module doc)."""

    def __init__(self, path: Path):
        self._byte_id = [-1] * 256
        self._bridges: list[tuple[str, int]] = []  # (piece, where U+2581 follows another character in it)
        super().__init__(path)
        self._bridges = tuple(self._bridges)
        self._part = lru_cache(maxsize=_REMEMBERED_PARTS)(self._merge)

    def _read(self, arrays: dict[str, np.ndarray], n: int) -> bool:
        scores, flags = arrays.get("scores"), arrays.get("flags")
        if scores is None or flags is None or len(scores) != n or flags.shape != (4,):
            return False
        self._scores = array("f", scores.astype(np.float32).tobytes())
        self.add_prefix, self.add_bos = bool(flags[0]), bool(flags[1])
        self.bos_id = int(flags[2]) if 0 <= flags[2] < n else None
        self.unk_id = int(flags[3]) if 0 <= flags[3] < n else None
        return True

    def _note(self, token: int, piece: str, kind: int) -> None:
        if kind == BYTE and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            self._byte_id[int(piece[3:5], 16)] = token
        if SPACE in piece[1:]:
            self._bridges += [(piece, k) for k in range(1, len(piece)) if piece[k] == SPACE and piece[k - 1] != SPACE]

    def _keeps_text(self) -> bool:
        return all(b >= 0 for b in self._byte_id)  # a character without a piece falls back to its bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens`: the BOS the vocabulary asks for."""
        ids = [self.bos_id] if add_special_tokens and self.add_bos and self.bos_id is not None else []
        for part, token in self._verbatim_split(text):
            if token is None:
                ids += self._stretch(part)
            else:
                ids.append(token)
        return ids

    def piece_bytes(self, token: int) -> bytes:
        """The bytes piece `token` stands for inside a text: a byte piece its byte, any
        other its text with U+2581 as a space."""
        piece = self.piece(token)
        if self._types[token] == BYTE and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SPACE, " ").encode("utf-8")

    def encode_fragment(self, text: str) -> list[int]:
        """Token ids of `text` as the middle of a longer text: no BOS, no prefix space."""
        ids = []
        for part, token in self._verbatim_split(text):
            ids += self._stretch(part, prefix=False) if token is None else [token]
        return ids

    def _stretch(self, text: str, prefix: bool = True) -> list[int]:
        """Ids of text between verbatim pieces, cut into parts at word starts (`prefix`:
        the vocabulary's prefix space, where it asks for one)."""
        if not text:
            return []
        text = text.replace(" ", SPACE)
        if self.add_prefix and prefix:
            text = SPACE + text
        ids: list[int] = []
        start = 0
        for m in _WORD_START.finditer(text):
            at = m.start()
            if not any(text[at - k:at - k + len(p)] == p for p, k in self._bridges):
                ids += self._part(text[start:at])
                start = at
        ids += self._part(text[start:])
        return ids

    def _mergeable(self, left: int, right: int, text: str, heap: list, position: int) -> None:
        merged = self.token_to_id(text)
        if merged is not None and self._types[merged] == NORMAL:
            heapq.heappush(heap, (-self._scores[merged], left, right, position, merged))

    def _merge(self, text: str) -> tuple[int, ...]:
        """Ids of one part: characters merged pairwise, best-scoring merge first."""
        symbols: list[int] = []  # a piece id, or -1 - byte for a byte fallback
        for ch in text:
            token = self.token_to_id(ch)
            if token is not None:
                symbols.append(token)
            else:
                symbols += [-1 - b for b in ch.encode("utf-8")]
        count = len(symbols)
        texts = [self.piece(s) if s >= 0 else "" for s in symbols]
        after = list(range(1, count + 1))
        before = list(range(-1, count - 1))
        heap: list = []
        for i in range(count - 1):
            if symbols[i] >= 0 and symbols[i + 1] >= 0:
                self._mergeable(symbols[i], symbols[i + 1], texts[i] + texts[i + 1], heap, i)
        while heap:
            _, left, right, i, merged = heapq.heappop(heap)
            j = after[i]
            if symbols[i] != left or j >= count or symbols[j] != right:
                continue  # a stale pair: one side merged since
            symbols[i], texts[i] = merged, texts[i] + texts[j]
            symbols[j] = None
            after[i] = after[j]
            if after[j] < count:
                before[after[j]] = i
            if before[i] >= 0 and symbols[before[i]] is not None and symbols[before[i]] >= 0:
                p = before[i]
                self._mergeable(symbols[p], merged, texts[p] + texts[i], heap, p)
            if after[i] < count and symbols[after[i]] >= 0:
                self._mergeable(merged, symbols[after[i]], texts[i] + texts[after[i]], heap, i)
        out: list[int] = []
        for s in symbols:
            if s is None:
                continue
            if s >= 0:
                out.append(s)
            elif self._byte_id[-1 - s] >= 0:
                out.append(self._byte_id[-1 - s])
            elif self.unk_id is not None and not (out and out[-1] == self.unk_id):
                out.append(self.unk_id)  # no byte piece: unknown, consecutive ones fused
        return tuple(out)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (ids outside the vocabulary are dropped; a run of byte pieces
        that is not UTF-8 gives U+FFFD a byte)."""
        out: list[str] = []
        pending = bytearray()
        for token in ids:
            if not 0 <= token < self._size or (skip_special_tokens and self._types[token] == CONTROL):
                continue
            piece = self.piece(token)
            if self._types[token] == BYTE and len(piece) == 6 and piece.startswith("<0x"):
                pending.append(int(piece[3:5], 16))
                continue
            if pending:
                out.append(_bytes_text(pending))
                pending.clear()
            out.append(piece.replace(SPACE, " "))
        if pending:
            out.append(_bytes_text(pending))
        text = "".join(out)
        return text[1:] if self.add_prefix and text.startswith(" ") else text


def _bytes_text(data: bytearray) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(data)

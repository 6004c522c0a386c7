"""A GGUF vocabulary held in a few flat arrays instead of per-piece Python objects: the
part JustFit's own tokenizers (justfit.model.sentencepiece, justfit.model.bytelevel) share.

The pieces are one UTF-8 byte string with offsets and their types one byte each; a piece
is found through an open-addressing table of its hash (an `array` of ids and one of
64-bit hashes). Control and user-defined pieces are matched verbatim in the raw text
before anything else (leftmost, the longest where several start at one position), as
the `tokenizers` library's added tokens are.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np

# GGUF's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class BadVocabulary(ValueError):
    """A vocabulary file that is not one JustFit wrote (truncated, altered, or another format)."""
    pass


def piece_arrays(meta: dict) -> dict[str, np.ndarray]:
    """A GGUF vocabulary's pieces as the stored arrays `pieces` (UTF-8 bytes, one
    string), `offsets` and `types`."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    encoded = [t.encode("utf-8") for t in tokens]
    offsets = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    return {"pieces": np.frombuffer(b"".join(encoded), np.uint8), "offsets": offsets,
            "types": np.asarray(types, np.uint8)}


class StoredVocabulary:
    """The pieces of one stored vocabulary file; a tokenizer subclasses it, reading its
    own arrays in `_read` and noting pieces of interest in `_note` as they are indexed."""

    def __init__(self, path: Path):
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
            blob, offsets, types = arrays["pieces"].tobytes(), arrays["offsets"], arrays["types"]
        except Exception as e:
            raise BadVocabulary(f"{path}: not a readable vocabulary ({e}); delete its folder to convert "
                                f"the model again") from e
        n = len(types)
        if (len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(blob) or len(blob) >= 1 << 31
                or np.any(np.diff(offsets) < 0) or not self._read(arrays, n)):
            raise BadVocabulary(f"{path}: its arrays do not describe one vocabulary; delete its folder to "
                                f"convert the model again")
        self._blob = blob
        self._offsets = array("i", offsets.astype(np.int32).tobytes())
        self._types = bytes(types.astype(np.uint8))
        self._size = n
        try:
            self._index_pieces()
        except (UnicodeDecodeError, ValueError) as e:
            raise BadVocabulary(f"{path}: a piece is not UTF-8 text ({e}); delete its folder to convert "
                                f"the model again") from e

    def _read(self, arrays: dict[str, np.ndarray], n: int) -> bool:
        """Take the subclass's own arrays; False when they do not fit `n` pieces."""
        return True

    def _note(self, token: int, piece: str, kind: int) -> None:
        """See one piece while the table is built (byte pieces, pieces spanning words...)."""

    def _index_pieces(self) -> None:
        """The hash table and the verbatim pieces by first character."""
        n = self._size
        slots = 1 << max(4, (n * 4 // 3).bit_length())
        self._mask = slots - 1
        self._slot_id = array("i", [-1]) * slots
        self._slot_hash = array("q", [0]) * slots
        verbatim: dict[str, list[int]] = {}  # first character -> lengths
        self._verbatim_ids: dict[str, int] = {}
        for i in range(n):
            piece = self.piece(i)
            h = hash(piece)
            j = h & self._mask
            while self._slot_id[j] >= 0:
                if self._slot_hash[j] == h and self.piece(self._slot_id[j]) == piece:
                    break  # a duplicate piece keeps its first id
                j = (j + 1) & self._mask
            else:
                self._slot_id[j], self._slot_hash[j] = i, h
            kind = self._types[i]
            if kind in (CONTROL, USER_DEFINED) and piece:
                self._verbatim_ids.setdefault(piece, i)
                verbatim.setdefault(piece[0], []).append(len(piece))
            self._note(i, piece, kind)
        self._verbatim = {c: sorted(set(lengths), reverse=True) for c, lengths in verbatim.items()}

    def __len__(self) -> int:
        return self._size

    def piece(self, token: int) -> str:
        """The text of piece `token` as stored."""
        return self._blob[self._offsets[token]:self._offsets[token + 1]].decode("utf-8")

    def piece_bytes(self, token: int) -> bytes:
        """The bytes of text piece `token` stands for inside a text (what a grammar
        matches it against: justfit.engine.grammar)."""
        return self.piece(token).encode("utf-8")

    def is_control(self, token: int) -> bool:
        """Whether piece `token` is a control piece (end of turn, BOS...): never text."""
        return self._types[token] == CONTROL

    def encode_fragment(self, text: str) -> list[int]:
        """Token ids of `text` as the middle of a longer text: no BOS, no prefix space."""
        return self.encode(text, add_special_tokens=False)

    def token_to_id(self, text: str) -> int | None:
        """The id of the piece whose text is `text`, if any."""
        h = hash(text)
        j = h & self._mask
        while (i := self._slot_id[j]) >= 0:
            if self._slot_hash[j] == h and self.piece(i) == text:
                return i
            j = (j + 1) & self._mask
        return None

    def get_vocab(self) -> dict[str, int]:
        """Piece text -> id, every piece (built on each call: large)."""
        vocab: dict[str, int] = {}
        for i in range(self._size):
            vocab.setdefault(self.piece(i), i)
        return vocab

    def longest_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token stands for (at least 4, a character);
        None when some text may become no token or an unknown one of any length (then a
        text's size bounds nothing: justfit.server.prompt_bytes)."""
        if not self._keeps_text():
            return None
        return max(4, max((self._text_bytes(self.piece(i)) for i in range(self._size)), default=1))

    def _keeps_text(self) -> bool:
        """Whether every character of any text becomes at least one token."""
        return False

    def _text_bytes(self, piece: str) -> int:
        """UTF-8 bytes of the text `piece` stands for (at most)."""
        return len(piece.encode("utf-8"))

    def _verbatim_split(self, text: str) -> list[tuple[str, int | None]]:
        """`text` cut around its control and user-defined pieces: (stretch, None) for the
        text between them, (piece, id) for each; leftmost first, the longest where
        several start at one position, none overlapping."""
        out: list[tuple[str, int | None]] = []
        i, start, end = 0, 0, len(text)
        while i < end:
            for length in self._verbatim.get(text[i], ()):
                token = self._verbatim_ids.get(text[i:i + length])
                if token is not None:
                    if start < i:
                        out.append((text[start:i], None))
                    out.append((text[i:i + length], token))
                    i = start = i + length
                    break
            else:
                i += 1
        if start < end:
            out.append((text[start:], None))
        return out

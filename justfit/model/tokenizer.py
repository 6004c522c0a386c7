"""The tokenizer of a model JustFit converted from GGUF: its vocabulary held in arrays
(justfit.model.sentencepiece, justfit.model.bytelevel; the `tokenizers` library for a
folder converted before they existed) and a sandboxed Jinja chat template, without
`transformers`.

mlx-lm's TokenizerWrapper wraps a transformers tokenizer, and importing transformers
holds tens of MiB resident (more with the wrapper's Python-side vocabulary): under a
whole-process budget, thousands of KV positions.
A converted folder's tokenizer.json and tokenizer_config.json are JustFit's own
(justfit/model/gguf/tokenizer.py), so this class reads them directly, with the part of the
wrapper's interface JustFit uses: `encode`, `decode`, `apply_chat_template`,
`chat_template`, `eos_token_ids`, `bos_token_id`, `vocab` and `detokenizer`.
Templates with tool-call markup go through mlx-lm's wrapper instead (its tool parsers);
justfit.model.models decides.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from justfit.model import bytelevel, sentencepiece


class LibraryTokenizer:
    """A tokenizer.json read by the `tokenizers` library, behind SentencePieceBPE's methods."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        """The id of the token `text`, if any."""
        return self._tokenizer.token_to_id(text)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, every token."""
        return self._tokenizer.get_vocab()

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer as the `tokenizers` library's JSON text."""
        return self._tokenizer.to_str()


class StreamingText:
    """One reply's tokens to text, a piece at a time (the detokenizer interface of
    mlx-lm: `reset`, `add_token`, `finalize`, `last_segment`). A character split
    across tokens comes out whole, once its last byte arrived: the text of the tokens
    since the last piece let out is decoded with the piece before them as context,
    and let out when it grew and does not end inside a character."""

    def __init__(self, decode):
        self._decode = decode
        self.reset()

    def reset(self) -> None:
        """Start a new reply."""
        self.tokens: list[int] = []
        self._context, self._read = 0, 0  # token offsets: the decoding context's start; what was let out
        self._shown, self._pending = 0, ""  # characters let out so far; text not yet read

    def add_token(self, token: int) -> None:
        """Take the reply's next token; its text (if a whole character) waits in `last_segment`."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._context:self._read])
        now = self._decode(self.tokens[self._context:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            piece = now[len(before):]
            self._pending += piece
            self._shown += len(piece)
            self._context, self._read = self._read, len(self.tokens)

    def finalize(self) -> None:
        """Let out what the stream still holds (bytes of an unfinished character, as
        U+FFFD: the reply ended inside it)."""
        text = self._decode(self.tokens)
        self._pending += text[self._shown:]
        self._shown = len(text)

    @property
    def last_segment(self) -> str:
        """The text let out since the last read."""
        text, self._pending = self._pending, ""
        return text


class GGUFTokenizer:
    """A converted GGUF model's tokenizer (see the module doc)."""

    def __init__(self, folder: Path, eos_token_ids: list[int] | None = None):
        if (folder / sentencepiece.FILE_NAME).exists():
            self._tokenizer = sentencepiece.SentencePieceBPE(folder / sentencepiece.FILE_NAME)
        elif (folder / bytelevel.FILE_NAME).exists():
            self._tokenizer = bytelevel.ByteLevelBPE(folder / bytelevel.FILE_NAME)
        else:
            self._tokenizer = LibraryTokenizer(folder / "tokenizer.json")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.chat_template: str | None = config.get("chat_template")
        self.special_tokens = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if isinstance(config.get(k), str)}
        eos = self._id(self.special_tokens.get("eos_token"))
        self.eos_token_ids = set(eos_token_ids or []) | ({eos} if eos is not None else set())
        self.bos_token_id = self._id(self.special_tokens.get("bos_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens`: the BOS the model's GGUF asks for."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def pieces(self):
        """The vocabulary itself: a StoredVocabulary (justfit.model.vocabulary), or for a
        folder converted before those existed a LibraryTokenizer."""
        return self._tokenizer

    @property
    def vocab(self) -> dict[str, int]:
        """Token text -> id, every token."""
        return self._tokenizer.get_vocab()

    def __len__(self) -> int:
        return len(self._tokenizer)

    @property
    def detokenizer(self) -> StreamingText:
        """A fresh streaming detokenizer (each caller its own)."""
        return StreamingText(self._tokenizer.decode)

    def apply_chat_template(self, conversation: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """`conversation` rendered with `chat_template` (else the model's), as text or
        as token ids (the template writes the special tokens itself)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; pass chat_template=")
        text = _compiled(template).render(messages=conversation, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          **self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in Jinja's immutable sandbox (templates come from model
    files: untrusted code), with the globals and filters Hugging Face chat templates use."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which chat templates must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template)

"""The server's tokenizer thread. Chat templating, tokenization, planning and the
token texts of logprobs run here, never on the event loop: a 100K-token prompt
takes seconds to tokenize, and on the loop it would stall every connection,
/health included. One thread, so the server never uses the Hugging Face tokenizer
from two threads at once (its Rust core refuses a use that overlaps one that
changes its settings). The engine thread's streaming detokenizer works from
mlx-lm's own tables (BPE, SentencePiece), or for other tokenizers calls `decode`,
which changes nothing.

The thread also measures, first thing at start, the vocabulary's longest token
(justfit/server/prompt_bytes.py): the bound a prompt's size is checked against on
the loop before it is queued here."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from justfit.server.prompt_bytes import longest_token_bytes, refuse_oversized

T = TypeVar("T")


class TokenizerThread:
    """One worker thread for everything that touches the tokenizer on the server side."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="justfit-tokenizer")
        self._longest: Future | None = None

    def measure(self, tokenizer) -> None:
        """Start measuring `tokenizer`'s longest token on the thread (once; at server start)."""
        if self._longest is None:
            self._longest = self._pool.submit(longest_token_bytes, tokenizer)

    async def refuse_oversized(self, engine, *values, ids: int = 0, param: str = "messages") -> None:
        """BadRequest when the text in `values` (and `ids` token ids) is too many bytes to
        fit `engine`'s context whatever it tokenizes to (prompt_bytes.refuse_oversized);
        on the loop, before the prompt waits for this thread."""
        self.measure(engine.tokenizer)
        refuse_oversized(engine.context_limit, await asyncio.wrap_future(self._longest), *values, ids=ids,
                         param=param)

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread; its result or exception here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop taking work; what is queued is dropped, a running call finishes."""
        self._pool.shutdown(wait=False, cancel_futures=True)

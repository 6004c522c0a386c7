"""The server's tokenizer thread. Chat templating, tokenization, planning and the
token texts of logprobs run here, never on the event loop: a 100K-token prompt
takes seconds to tokenize, and on the loop it would stall every connection,
/health included. One thread, so the server never uses the Hugging Face tokenizer
from two threads at once (its Rust core refuses a use that overlaps one that
changes its settings). The engine thread's streaming detokenizer works from
mlx-lm's own tables (BPE, SentencePiece), or for other tokenizers calls `decode`,
which changes nothing."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class TokenizerThread:
    """One worker thread for everything that touches the tokenizer on the server side."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="justfit-tokenizer")

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread; its result or exception here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop taking work; what is queued is dropped, a running call finishes."""
        self._pool.shutdown(wait=False, cancel_futures=True)

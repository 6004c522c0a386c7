"""What the stored-state tests share: an engine on small fp16 pages with its own
state directory, greedy runs of it, and random token prompts."""

from __future__ import annotations

import random

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from kvexec import KVConfig

SMALL_PAGES = KVConfig(format="fp16", page_size=16, hot_window=16, block_tokens=64)


def paged_engine(path, state_dir, **kw) -> Engine:
    """An engine on `path` with small fp16 pages and 16-token prefill chunks."""
    return Engine(str(path), config=EngineConfig(kv=SMALL_PAGES, prefill_chunk=16, state_dir=str(state_dir), **kw))


def run_tokens(engine: Engine, tokens: list[int], sp: SamplingParams, session: str | None = None) -> list[int]:
    """The tokens `engine` generates for `tokens`."""
    return [c.token for c in engine.generate(tokens, sp, session=session) if c.token is not None]


def words(n: int, seed: int) -> list[int]:
    """`n` random token ids (no special tokens), reproducible from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def prefilled(engine: Engine, tokens: list[int]) -> list:
    """A fresh cache of `engine` holding `tokens`."""
    from justfit.engine.generate import prefill

    cache = engine.new_cache()
    prefill(engine.model, tokens, cache, 16)
    return cache


def tiers_like(engine: Engine, path, memory: int = 1 << 40, **kw):
    """StateTiers for `engine`'s model at `path` (no fault injection), limits as given."""
    from statetrans.faults import Faults
    from statetrans.tiers import StateTiers

    s = engine.states
    return StateTiers(path, s.identity, s.layers, memory, 1 << 40, Faults(), **kw)

"""KVExec: KV cache in compressed pages, attention executed on the pages.

Public API: `KVConfig`, `make_cache(model, config)`, `install(model)`, `trim(cache, n)`,
`can_trim(cache, n)`, `pin(cache, n)` (retention keeps the prompt), the formats
(`FORMATS`, `get_format`) and `blockwise_attention`.
"""

from kvexec.attention import Block, blockwise_attention
from kvexec.cache import PagedKVCache, can_trim, for_head_dim, make_cache, pin, trim
from kvexec.formats import FORMATS, KVFormat, get_format
from kvexec.seam import install
from kvexec.store import KVConfig, PageStore

__all__ = ["Block", "FORMATS", "KVConfig", "KVFormat", "PageStore", "PagedKVCache",
           "blockwise_attention", "can_trim", "for_head_dim", "get_format", "install", "make_cache", "pin", "trim"]

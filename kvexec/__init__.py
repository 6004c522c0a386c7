"""KVExec: KV cache in compressed pages, attention executed on the pages.

Public API: `KVConfig`, `make_cache(model, config)`, `install(model)` (refuses, with
`SeamBypassed`, a model whose attention bypasses the executor), `trim(cache, n)`,
`can_trim(cache, n)`, `pin(cache, n)` (retention keeps the prompt), `keep_exact(cache, n)`
(a trim back to n restores the layout held there, bit for bit), `chunk_room(cache, chunk)`
(a prefill chunk that attends to the pages each position would alone),
`limit_pages(cache, bytes)` (pages step down `KVConfig.pressure` to stay within it),
`page_formats(cache)`, pages on disk (`spill_layers`, `detach_disk`, `disk_bytes`;
kvexec.disk_pages), `page_bytes_per_token(config, kv_heads, head_dim)`, `ladder(config, head_dim)`, the formats (`FORMATS`,
`get_format`), `blockwise_attention` and `transient_bytes` (what it holds beyond its inputs).
"""

from kvexec.attention import Block, blockwise_attention, transient_bytes
from kvexec.cache import (PagedKVCache, SeamBypassed, can_trim, chunk_room, for_head_dim, keep_exact, limit_pages, make_cache, page_bytes_per_token,
                          page_formats, pin, trim)
from kvexec.cache import detach_disk, disk_bytes, row_invariant, spill_layers
from kvexec.formats import FORMATS, KVFormat, get_format
from kvexec.seam import install
from kvexec.config import KVConfig
from kvexec.pressure import ladder
from kvexec.store import PageStore

__all__ = ["Block", "FORMATS", "KVConfig", "KVFormat", "PageStore", "PagedKVCache", "SeamBypassed",
           "blockwise_attention", "can_trim", "chunk_room", "for_head_dim", "get_format", "install", "keep_exact", "ladder", "limit_pages",
           "make_cache", "page_bytes_per_token", "page_formats", "pin", "transient_bytes", "trim",
           "spill_layers", "detach_disk", "disk_bytes", "row_invariant"]

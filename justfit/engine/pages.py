"""A request's KV pages bound to its plan, and let go after it.

The planner (justfit.planning.plan) says how many growing layers keep their pages on disk and
what the resident pages may take; here that becomes the cache's page limit, the layers
spilled to a page file in the KV folder with a reader for them, and the pinned prompt.
The lone request's runner and a batch's sequences bind the same way.
"""

from __future__ import annotations

import kvexec
from kvexec.cache import PagedKVCache
from kvexec.disk_pages import PageFile, PageReader
from justfit.config import EngineConfig
from justfit.planning.cost_model import Footprint


def bind(config: EngineConfig, cache: list, plan: Footprint, room: int | None, prompt_tokens: int,
         row_invariant: bool = False) -> PageReader | None:
    """Hold `cache`'s resident pages to `room` bytes (None: no limit), put the plan's
    layers (under `config`'s KV folder) on disk, pin the prompt, and with `row_invariant`
    attend to each row as a lone query at its position would (justfit.engine.numerics); the
    reader of the pages on disk (None: none are)."""
    reader = None
    if config.kv is not None:
        kvexec.row_invariant(cache, row_invariant)
        layers = plan.shape.disk_layers
        stores = [c.store for c in cache if isinstance(c, PagedKVCache)]
        if layers or any(s.spilled() for s in stores):
            page_file = next((s.page_file for s in stores if s.page_file is not None), None)
            if page_file is None and layers:
                page_file = PageFile(config.kv_disk, keep_cached=config.kv_disk_cached)
            reader = PageReader()
            kvexec.spill_layers(cache, page_file, reader, layers)
        resident = plan.shape.full_layers - plan.shape.disk_layers
        if resident > 0:
            kvexec.limit_pages(cache, None if room is None else room // resident)
    if config.kv is None or config.kv.pin_prompt:
        kvexec.pin(cache, prompt_tokens)  # retention never evicts the prompt
    return reader


def release(cache: list | None, reader: PageReader | None) -> None:
    """Stop `reader` (reads in flight finish) and let the cache read its spilled pages
    directly until it is bound again."""
    if reader is None:
        return
    reader.close()
    if cache is not None:
        kvexec.detach_disk(cache)


def disk_stats(cache: list | None, reader: PageReader | None) -> dict | None:
    """What a request's pages on disk came to: bytes on disk, bytes read, the reader's
    seconds and the seconds attention waited for it (None: nothing on disk)."""
    on_disk = 0 if cache is None else kvexec.disk_bytes(cache)
    if reader is None and not on_disk:
        return None
    read = reader.bytes_read if reader else 0
    read_s = reader.read_s if reader else 0.0
    return {"bytes_on_disk": on_disk, "bytes_read": read, "read_s": round(read_s, 4),
            "wait_s": round(reader.wait_s, 4) if reader else 0.0,
            "read_mb_s": round(read / read_s / 1e6, 1) if read_s > 0 else None}

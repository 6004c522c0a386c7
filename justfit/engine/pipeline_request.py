"""A request on rank 0 of a layer pipeline (justfit.pipeline.layers): plan it, resume from the
state every rank still holds, prefill what is new, decode with the request's own
sampler and stops, keep the state it ends with on every rank, and report its stats.
A pipeline runs one request at a time (justfit.engine.pipeline_runner); a single
process runs every request as a sequence in a batch (justfit.engine.batch)."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import mlx.core as mx

from justfit.planning.plan import measure_request
from justfit.config import SamplingParams
from justfit.engine.generate import ProgressFn, decode, prefill, token_logprobs
from justfit.memory import MemoryReport, memory_report, trimming
from justfit.engine.sampling import keyed_sampler, logits_processors, new_rng
from justfit.engine.stats import Chunk, GenerationStats
from justfit.engine.stops import ReplyText
import kvexec
from justfit.engine import pages
from justfit.pipeline.layers import Pipeline, PipelineRun, resume
from statetrans import holds


def run_request(engine, pipeline: Pipeline, run: PipelineRun, tokens: list[int], sp: SamplingParams,
                progress: ProgressFn | None = None) -> Iterator[Chunk]:
    """Stream the reply to `tokens` on rank 0 of `pipeline` (see Engine.generate),
    resuming from and leaving `run.live`: closing the iterator early cancels cleanly,
    and the state kept then holds exactly the tokens computed."""
    offloaded, request = engine.planner.check_fits(len(tokens), sp.max_tokens)
    measure = measure_request(engine.planner)
    engine.swap.offload(offloaded)
    stats = GenerationStats(prompt_tokens=len(tokens), planned_bytes=request.total)
    # A pipeline keeps its last state on every rank (stored states are one process's).
    reuse, run.live = resume(pipeline.link, run.live, tokens), None
    cache = reuse.cache if reuse.cache is not None else engine.new_cache()
    budget = engine.budget.bytes
    reader = pages.bind(engine.config, cache, request, None if budget is None else request.page_allowance(budget),
                        len(tokens))
    held = reuse.tokens  # exactly what `cache` holds, extended as tokens are computed
    stats.cached_tokens, stats.restored_from, stats.restore_s = len(held), reuse.source, reuse.seconds
    rng = new_rng(sp.seed) if sp.seed is not None else (reuse.sampler or new_rng())
    try:
        yield from _run(engine, tokens, cache, held, rng, sp, stats, progress, request.shape.chunk,
                        request.shape.dense_prefill, reader)
    finally:
        # Also on cancel or error: what was computed is stored, once evaluated
        # (StateTiers.put), unless an interrupt left the cache and tokens apart.
        pages.release(cache, reader)
        kept = bool(held) and holds(cache, len(held))  # else an interrupt left cache and tokens apart
        run.live = (list(held), cache, rng) if kept else None
        engine.states.fit(engine.planner.state_allowance(engine.planner.footprint(1, engine.swap.offloaded)))
        stats.memory = _memory(engine, stats, cache)
        stats.kv_formats = kvexec.page_formats(cache)
        measure.done(request, len(held), stats.memory)


def _run(engine, tokens: list[int], cache: list, held: list[int], rng: dict, sp: SamplingParams,
         stats: GenerationStats, progress: ProgressFn | None, chunk: int, dense_prefill: bool,
         reader=None) -> Iterator[Chunk]:
    cached = len(held)
    # The same prompt again resumes from here (all but the last token): trimmed back
    # exactly, it computes the reply this request computes.
    kvexec.keep_exact(cache, len(tokens) - 1)
    record: Callable[[list[int]], None] = held.extend
    if engine.budget.bytes is not None:
        record = trimming(record)
    if sp.max_tokens == 0:
        stats.finish_reason = "length"
        yield Chunk("", finish_reason="length", stats=stats)
        return
    wrapped = (lambda done, total: progress(cached + done, len(tokens))) if progress else None
    with engine.swap.phase("prefill", dense=dense_prefill) as phase:
        stats.phases.append(phase)
        stats.prefill_chunk = chunk
        logits = prefill(engine.model, tokens[cached:], cache, chunk, wrapped, record, engine.numerics.deterministic)
    stats.prefill_s = phase.seconds
    sampler = keyed_sampler(sp, int(logits.shape[-1]), rng)
    processors = logits_processors(sp, len(tokens))
    with engine.swap.phase("decode") as phase:
        stats.phases.append(phase)
        tail = yield from _decode(engine, logits, tokens, cache, sp, stats, sampler, processors, record)
    stats.memory = _memory(engine, stats, cache)  # the last chunk carries complete stats
    stats.kv_disk = pages.disk_stats(cache, reader)
    yield Chunk(tail, finish_reason=stats.finish_reason, stats=stats)


def _memory(engine, stats: GenerationStats, cache: list) -> MemoryReport:
    peak = max([p.peak_bytes for p in stats.phases] + [mx.get_peak_memory()])
    states = engine.states
    stored = states.memory_bytes - (states.last.nbytes if states.last and states.last.cache is cache else 0)
    return memory_report(engine.swap.registry.resident_bytes(), cache, peak, stored)


def _decode(engine, logits, tokens, cache, sp, stats, sampler, processors, record):
    """Yield a chunk per token; return the text held back at the end."""
    reply = ReplyText(engine.tokenizer, sp, stats)
    start = time.perf_counter()
    seen: dict[str, tuple] = {}  # the last token's logprobs, when asked for

    def note(token: int, logprobs: mx.array) -> None:
        seen["last"] = token_logprobs(token, logprobs, sp.logprobs)

    for token in decode(engine.model, logits, cache, sampler, processors, tokens, record,
                        note if sp.logprobs is not None else None):
        text = reply.add(token)
        if text is None:  # end-of-sequence
            break
        stats.decode_s = time.perf_counter() - start
        logprob, top = seen.get("last", (None, None))
        yield Chunk(text, token, logprob=logprob, top_logprobs=top)  # one per token, text may be "" (partial UTF-8)
        if reply.reason:
            break
    tail = reply.end()
    stats.decode_s = time.perf_counter() - start
    return tail

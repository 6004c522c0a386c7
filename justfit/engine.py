"""The engine: one loaded model, a memory budget, and a conversation whose computed
state is kept between requests so a growing chat only prefills what is new."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import psutil
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from justfit import blas
from justfit.config import EngineConfig, SamplingParams
from justfit.errors import BudgetExceeded, ContextTooLong
from justfit.generate import ProgressFn, decode, prefill, token_logprobs
from justfit.gguf_import import RequantOptions, cache_root
from justfit.memory import (MemoryReport, hold_memory_to, memory_report, parse_size, peak_rss_bytes, trim_heap,
                            trimming)
from justfit.models import LoadedModel, load, weight_files
from justfit.outside import decayed_max, measure_outside
from justfit.planner import MIN_PREFILL_CHUNK, PAGE_MARGIN, Footprint, attention_shape, choose_policy, footprint
from justfit.state_io import (StateIO, export_state, import_state, resume_session, save_session, state_identity,
                               state_root)
from justfit.stats import Chunk, GenerationStats
from justfit.stops import StopMatcher
import kvexec
from kvexec import KVConfig
from phaseswap import PhaseSwap
from phaseswap.policy import Policy, get_policy
from statetrans import StateTiers, holds

Prompt = str | list[dict[str, str]] | list[int]

# Used when a model ships no chat template (base models).
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


class Engine:
    """A model behind a memory budget, generating from text, chat messages or tokens."""

    def __init__(self, model: str | None = None, budget: int | str | None = None,
                 config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        if budget is not None:
            self.config.budget_bytes = parse_size(budget)
        opts = RequantOptions(bits=self.config.gguf_bits, embed_bits=self.config.gguf_embed_bits)
        loaded = load(model, opts, lazy=True)  # PhaseSwap reads it one component at a time
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.name, self.path = loaded.name, loaded.path
        trim_heap()  # what loading the tokenizer freed goes back to the system
        self._process_budget: int | None = None  # a whole-process budget, if given
        self._outside = 0  # what the process holds besides MLX: a decaying maximum over requests
        if self.config.budget_bytes is not None and self.config.budget_covers_process:
            # Weights are not read yet (lazy load): what the process holds now besides
            # MLX is the interpreter, libraries and tokenizer; the engine gets the rest.
            self._process_budget = self.config.budget_bytes
            self._measure_outside()
            self.config.budget_covers_process = False
        if self.config.kv is not None:
            kvexec.install(self.model)
            head_dim = attention_shape(self.model, self.model_config)[2]
            self.config.kv = kvexec.for_head_dim(self.config.kv, head_dim)
        trained = self.model_config.get("max_position_embeddings") or 1 << 20
        self.context_limit = self.config.context_limit or trained
        self.policy: Policy = get_policy(choose_policy(self.model, self.model_config, self.config.policy,
                                                       self.context_limit, self.config.kv, self.config.budget_bytes))
        self.blas = blas.active_blas()
        budget = self.config.budget_bytes
        weight_limit = None
        if budget is not None:
            hold_memory_to(budget)
            # What the smallest request needs besides weights; the rest may hold weights.
            need = self._footprint(1, 0, 0)
            weight_limit = budget - need.total
            if weight_limit <= 0:
                raise BudgetExceeded(need.total, budget, 0, need.positions)
        self.swap = PhaseSwap(self.model, self.policy, _stream_dir(loaded, self.policy), weight_limit)
        self.swap.registry.strict = budget is not None  # give freed memory back at once
        mx.clear_cache()  # the conversion's transients go back to the system, not MLX's cache
        trim_heap()  # and what converting the weights freed outside MLX
        c = self.config
        state_dir = state_root(c.state_dir)  # also remembers the weights' sha256 (model identity)
        self.states = StateTiers(state_dir, state_identity(self, state_dir), len(self.new_cache()),
                                 c.state_memory if c.state_memory is not None else psutil.virtual_memory().total // 4,
                                 c.state_disk)
        self.last_stats: GenerationStats | None = None
        self.live_cache: list | None = None  # the running request's state, for the status page

    # -- prompts ---------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if prompt and isinstance(prompt[0], dict):
            return self.apply_chat_template(prompt)
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        if not getattr(self.tokenizer, "chat_template", None):
            kwargs["chat_template"] = FALLBACK_TEMPLATE
        out = self.tokenizer.apply_chat_template(messages, **kwargs)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim)."""
        return attention_shape(self.model, self.model_config)

    def stored_bytes(self) -> int:
        """Size of the model's weight files on disk (0 when not a local folder)."""
        return sum(f.stat().st_size for f in weight_files(self.path))

    def set_budget(self, budget: int | str) -> None:
        """Hold later requests to `budget` (e.g. once what runs beside the engine is
        known); freed memory then goes back to the system at once, as under a budget
        given at load."""
        self.config.budget_bytes = parse_size(budget)
        self._process_budget = None
        self.swap.registry.strict = True
        hold_memory_to(self.config.budget_bytes)

    def _measure_outside(self, high_water: int = 0, mlx_peak: int = 0) -> None:
        """Under a whole-process budget, take what the process holds besides MLX off the
        engine's share: measured after each request (`high_water`, `mlx_peak`: see
        justfit.outside.measure_outside), a past spike forgotten over the next requests."""
        if self._process_budget is None:
            return
        self._outside = decayed_max(self._outside, measure_outside(high_water, mlx_peak))
        self.config.budget_bytes = self._process_budget - self._outside

    # -- planning --------------------------------------------------------------
    def _footprint(self, positions: int, weights: int | None, working: int,
                   kv: KVConfig | None | str = "engine", chunk: int | None = None,
                   pressed: bool = False) -> Footprint:
        return footprint(self.model, self.model_config, positions, chunk or self.config.prefill_chunk,
                         self.config.kv if kv == "engine" else kv, weights, working,
                         4 if self.policy.fp32 else 2, pressed)

    def footprint(self, positions: int, streamed: tuple[str, ...] = (),
                  kv: KVConfig | None | str = "engine", chunk: int | None = None,
                  pressed: bool = False) -> Footprint:
        """Memory for `positions` retained positions with `streamed` components on disk,
        prefilled `chunk` tokens at a time (default: the configured chunk); `kv`
        another KV configuration (None: mlx-lm's own cache) for comparisons; `pressed`:
        with pages stepped down to the last format of the pressure ladder."""
        reg = self.swap.registry
        weights = reg.total_bytes() - sum(reg.components[n].nbytes for n in streamed)
        return self._footprint(positions, weights, self.swap.working_bytes(streamed), kv, chunk, pressed)

    def _chunks(self) -> Iterator[int]:
        """Prefill chunk sizes to try, largest first: a smaller chunk shrinks the
        transient (scores, activations) at little cost, so it comes before streaming."""
        chunk = self.config.prefill_chunk
        yield chunk
        while self.config.budget_bytes is not None and chunk > MIN_PREFILL_CHUNK:
            chunk = max(MIN_PREFILL_CHUNK, chunk // 2)
            yield chunk

    def plan(self, positions: int) -> tuple[tuple[str, ...], Footprint]:
        """The fewest components to stream from disk, then pages kept in their format
        rather than stepped down the pressure ladder, then the largest prefill chunk, so
        `positions` fit the budget; and the footprint so (`shape.chunk` is the chunk,
        `page_allowance` what the pages may take). The last tried, when nothing fits."""
        order = self.swap.offload_order()
        budget = self.config.budget_bytes
        kv = self.config.kv
        # (pressed, the most the footprint may take): with the ladder to fall back on, wide
        # pages keep a margin from the budget's edge (as the ladder's own page limit does).
        tries = [(False, budget)]
        if budget is not None and kv is not None and len(kvexec.ladder(kv, self.kv_shape[2])) > 1:
            tries = [(False, budget * (1 - PAGE_MARGIN)), (True, budget)]
        for k in range(len(order) + 1):
            for pressed, edge in tries:
                for chunk in self._chunks():
                    fp = self.footprint(positions, tuple(order[:k]), chunk=chunk, pressed=pressed)
                    if edge is None or fp.total <= edge:
                        return tuple(order[:k]), fp
        return tuple(order), fp

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> tuple[tuple[str, ...], Footprint]:
        """Refuse, before any work, what the context or the budget cannot hold; return
        the plan it fits with (see `plan`)."""
        if prompt_tokens + max_tokens > self.context_limit:
            raise ContextTooLong(prompt_tokens, max_tokens, self.context_limit)
        kv = self.config.kv
        retain = kv.max_positions if kv is not None and kv.pin_prompt else None
        if retain is not None and prompt_tokens > retain:  # the prompt is pinned: never evicted
            raise ContextTooLong(prompt_tokens, 0, retain, "positions the KV retention budget keeps")
        positions = prompt_tokens + max_tokens
        streamed, fp = self.plan(positions)
        budget = self.config.budget_bytes
        if budget is not None and fp.total > budget:
            self._measure_outside()  # a refused request counts too: a spike must not refuse all for good
            raise BudgetExceeded(fp.total, budget, fp.max_positions(budget), positions)
        return streamed, fp

    # -- conversation state ------------------------------------------------------
    def new_cache(self) -> list:
        """Per-layer state for one sequence: KVExec pages, or mlx-lm's own caches."""
        if self.config.kv is None:
            from mlx_lm.models.cache import make_prompt_cache

            return make_prompt_cache(self.model)
        return kvexec.make_cache(self.model, self.config.kv)

    def reset(self) -> None:
        """Forget the stored states of past requests (named sessions stay)."""
        self.states.clear()
        self.last_stats = None

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens of the most recently stored state (the conversation so far)."""
        return list(self.states.last.tokens) if self.states.last else []

    def save_state(self, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
        """Snapshot a session's state (default: the most recent one) to `path`, KV
        pages as stored; `extra` (JSON) rides along and comes back from load_state."""
        return export_state(self, path, extra, session)

    def load_state(self, path: str, session: str | None = None) -> StateIO:
        """Resume a snapshot (as `session`, or as the latest conversation): the next
        request extending its tokens prefills only what is new. Raises
        statetrans.SnapshotError, with nothing changed, when it cannot."""
        return import_state(self, path, session)

    def fork(self, source: str, name: str) -> None:
        """Start session `name` from a copy of session `source`'s state."""
        if source not in self.states.sessions:
            raise KeyError(f"no session {source!r}")
        self.states.fork(source, name)

    def drop_session(self, name: str) -> None:
        """Delete session `name`, on disk too (the only way a session goes)."""
        self.states.drop(name)

    def save_session(self, name: str, extra: dict | None = None) -> StateIO:
        """Make the latest conversation the named session `name`: on disk now, and
        after every later turn requested with `session=name`; `extra` (JSON) is kept
        beside it (see `annotate_session`)."""
        return save_session(self, name, extra)

    def resume_session(self, name: str) -> StateIO | None:
        """Session `name` (from the state directory if need be) and its extra, or None;
        the next request with `session=name` prefills only what is new."""
        return resume_session(self, name)

    def annotate_session(self, name: str, extra: dict) -> None:
        """Replace what is kept beside session `name` (e.g. a chat's transcript)."""
        self.states.store.write_extra(name, extra)

    def flush_sessions(self) -> None:
        """Until every named session's latest turn is on disk (done at exit too)."""
        self.states.flush()

    def sessions(self) -> dict[str, int]:
        """Named sessions and the positions each holds."""
        entries = dict(self.states.entries)
        return {n: len(entries[k].tokens) for n, k in list(self.states.sessions.items()) if k in entries}

    def _state_allowance(self, request: Footprint) -> int | None:
        """What the budget leaves for stored states while `request` runs."""
        budget = self.config.budget_bytes
        return None if budget is None else max(0, budget - request.total)

    # -- generation --------------------------------------------------------------
    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None,
                 progress: ProgressFn | None = None, session: str | None = None) -> Iterator[Chunk]:
        """Stream the reply to `prompt`, starting from the stored state sharing the
        longest prefix with it (`session`'s own first). Closing the iterator early
        cancels cleanly: the state stored then holds exactly the tokens computed."""
        sp = sampling or SamplingParams()
        tokens = self.encode(prompt)
        if not tokens:
            raise ValueError("empty prompt")
        streamed, request = self.check_fits(len(tokens), sp.max_tokens)
        high_water = peak_rss_bytes()
        self.swap.stream(streamed)
        stats = GenerationStats(prompt_tokens=len(tokens), planned_bytes=request.total)
        reuse = self.states.take(tokens, session, self._state_allowance(request))
        cache = reuse.cache if reuse.cache is not None else self.new_cache()
        if self.config.kv is not None and request.shape.full_layers:
            budget = self.config.budget_bytes
            kvexec.limit_pages(cache, None if budget is None else
                               request.page_allowance(budget) // request.shape.full_layers)
        held = reuse.tokens  # exactly what `cache` holds, extended as tokens are computed
        self.live_cache = cache
        stats.cached_tokens, stats.restored_from, stats.restore_s = len(held), reuse.source, reuse.seconds
        rng = {"seed": sp.seed, "step": 0} if sp.seed is not None else (
            reuse.sampler or {"seed": int.from_bytes(os.urandom(4), "little"), "step": 0})
        try:
            yield from self._run(tokens, cache, held, rng, sp, stats, progress, request.shape.chunk)
        finally:
            # Also on cancel or error: what was computed is stored, once evaluated
            # (StateTiers.put), unless an interrupt left the cache and tokens apart.
            self.live_cache = None
            if held and holds(cache, len(held)):
                self.states.put(held, cache, session, rng)
            self.states.fit(self._state_allowance(self.footprint(1, self.swap.streamed)))
            stats.memory = self._memory(stats, cache)
            stats.kv_formats = kvexec.page_formats(cache)
            self.last_stats = stats
            self._measure_outside(high_water, stats.memory.mlx_peak)

    def _run(self, tokens: list[int], cache: list, held: list[int], rng: dict, sp: SamplingParams,
             stats: GenerationStats, progress: ProgressFn | None, chunk: int) -> Iterator[Chunk]:
        cached = len(held)
        if self.config.kv is None or self.config.kv.pin_prompt:
            kvexec.pin(cache, len(tokens))  # retention never evicts the prompt
        record: Callable[[list[int]], None] = held.extend
        if self.config.budget_bytes is not None:
            record = trimming(record)
        if sp.max_tokens == 0:
            stats.finish_reason = "length"
            yield Chunk("", finish_reason="length", stats=stats)
            return
        wrapped = (lambda done, total: progress(cached + done, len(tokens))) if progress else None
        with self.swap.phase("prefill") as phase:
            stats.phases.append(phase)
            stats.prefill_chunk = chunk
            logits = prefill(self.model, tokens[cached:], cache, chunk, wrapped, record)
        stats.prefill_s = phase.seconds
        vocab = int(logits.shape[-1])
        top_k = sp.top_k if sp.top_k < vocab else 0  # keeping every token is no filter
        sampler = _seeded(make_sampler(sp.temperature, sp.top_p, sp.min_p, top_k=top_k), rng)
        processors = make_logits_processors(
            repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1.0 else None,
            repetition_context_size=sp.repetition_context,
        ) + _reply_penalties(sp, len(tokens))
        with self.swap.phase("decode") as phase:
            stats.phases.append(phase)
            tail = yield from self._decode(logits, tokens, cache, sp, stats, sampler, processors, record)
        stats.memory = self._memory(stats, cache)  # the last chunk carries complete stats
        yield Chunk(tail, finish_reason=stats.finish_reason, stats=stats)

    def _memory(self, stats: GenerationStats, cache: list) -> MemoryReport:
        peak = max([p.peak_bytes for p in stats.phases] + [mx.get_peak_memory()])
        stored = self.states.memory_bytes - (self.states.last.nbytes if self.states.last
                                             and self.states.last.cache is cache else 0)
        return memory_report(self.swap.registry.resident_bytes(), cache, peak, stored)

    def _decode(self, logits, tokens, cache, sp, stats, sampler, processors, record):
        """Yield a chunk per token; return the text held back at the end."""
        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopMatcher(sp.stop)
        eos = set() if sp.ignore_eos else set(self.tokenizer.eos_token_ids)
        start = time.perf_counter()
        reason = "length"
        seen: dict[str, tuple] = {}  # the last token's logprobs, when asked for

        def note(token: int, logprobs: mx.array) -> None:
            seen["last"] = token_logprobs(token, logprobs, sp.logprobs)

        for token in decode(self.model, logits, cache, sampler, processors, tokens, record,
                            note if sp.logprobs is not None else None):
            if token in eos:
                reason = "stop"
                break
            stats.generated_tokens += 1
            detok.add_token(token)
            text, hit = stops.feed(detok.last_segment)
            stats.decode_s = time.perf_counter() - start
            logprob, top = seen.get("last", (None, None))
            yield Chunk(text, token, logprob=logprob, top_logprobs=top)  # one per token, text may be "" (partial UTF-8)
            if hit:
                reason = "stop"
                break
            if stats.generated_tokens >= sp.max_tokens:
                break
        detok.finalize()
        tail = stops.flush(detok.last_segment) if reason == "length" else ""
        stats.decode_s = time.perf_counter() - start
        stats.finish_reason, stats.stop_sequence = reason, stops.hit
        return tail

    def complete(self, prompt: Prompt, sampling: SamplingParams | None = None) -> str:
        """The whole reply as one string."""
        return "".join(c.text for c in self.generate(prompt, sampling))


def _stream_dir(loaded: LoadedModel, policy: Policy) -> Path:
    """Where streamed components of this model, in this policy's form, are kept."""
    source = f"{loaded.path or loaded.name}"
    source += "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in weight_files(loaded.path))
    key = hashlib.sha256(f"{source}|{policy.resident}|{policy.fp32}".encode()).hexdigest()[:16]
    return cache_root() / "stream" / key


def _seeded(sampler: Callable[[mx.array], mx.array], rng: dict) -> Callable[[mx.array], mx.array]:
    """`sampler` drawing token n of a state from a key fixed by (seed, n): the RNG
    position is two integers, stored with the state, so a restored conversation
    samples exactly what the uninterrupted one would have."""
    def sample(logprobs: mx.array) -> mx.array:
        mx.random.seed((rng["seed"] * 0x9E3779B1 + rng["step"]) % (1 << 63))
        rng["step"] += 1
        return sampler(logprobs)

    return sample


def _reply_penalties(sp: SamplingParams, prompt_len: int) -> list:
    """OpenAI's frequency and presence penalties, over the reply's tokens only (as
    vLLM does): a prompt's repeated words are no reason to avoid them in the answer."""
    procs = make_logits_processors(presence_penalty=sp.presence_penalty or None, presence_context_size=sp.max_tokens,
                                   frequency_penalty=sp.frequency_penalty or None,
                                   frequency_context_size=sp.max_tokens)
    return [lambda tokens, logits, p=p: p(tokens[prompt_len:], logits) for p in procs]


"""The engine: the public facade over one loaded model, a memory budget, and the
conversations whose computed state is kept between requests so a growing chat only
prefills what is new. Loading is in justfit.model.loader, budget accounting and plan search
in justfit.planning.budget, running requests in the runner chosen at load
(justfit.engine.runner: one process's batches, or a layer pipeline's), stored states in
justfit.engine.state_io and statetrans."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Iterator

import mlx.core as mx
import psutil

from justfit import blas, runtime
from justfit.planning.budget import check_fits, plan
from justfit.planning.outside import Budget, OutsideWatch, ProcessShare
from justfit.model.chat_template import render_chat
from justfit.config import EngineConfig, SamplingParams
from justfit.model import adapter, first_load
from justfit.errors import BudgetExceeded
from justfit.engine.generate import ProgressFn
from justfit.model.first_load import FirstLoad
from justfit.model.gguf.cache import RequantOptions
from justfit.model.loader import kv_calibration, kv_for_model, load_lazily, offload_dir
from justfit.planning.breakdown import LoadMarks, blas_warm_up, outside_anon
from justfit.memory import parse_size, trim_heap
from justfit.model.models import weight_files
from justfit.planning.planner import MIN_PREFILL_CHUNK, Footprint, attention_shape, choose_policy, footprint
from justfit.engine import numerics
from justfit.engine.draft import MAX_DRAFT
from justfit.engine.runner import Runner, choose_runner
from justfit.engine.speculate import StepCosts
from justfit.engine.state_io import (StateIO, folder_identity, model_identity, resume_session, save_session,
                                    state_identity, state_root)
from justfit.engine.stats import Chunk, Reply, collect
import kvexec
from kvexec import KVConfig
from phaseswap.predict import NATIVE_FORMS, predict_prefill_bytes, predict_resident_bytes, predict_working_bytes
from phaseswap.policy import ResidencyPolicy, get_policy
from statetrans import StateTiers
from kvexec import disk_pages
from statetrans.quota import default_state_disk, quarantine_limit, split_state_disk

Prompt = str | list[dict[str, str]] | list[int]


class Engine:
    """A model behind a memory budget, generating from text, chat messages or tokens.

    The engine works on its own copy of `config` (never the caller's): a budget given
    here, the engine's share of a whole-process budget and the KV format adapted to the
    model are in `engine.config`."""

    def __init__(self, model: str | None = None, budget: int | str | None = None,
                 config: EngineConfig | None = None, group=None):
        runtime.setup()  # idempotent: the shared exec stream for this thread (and OpenBLAS, if still in time)
        before_load = outside_anon()  # the interpreter and modules: the breakdown's first measured part
        config = config or EngineConfig()
        if budget is not None:
            config = replace(config, budget_bytes=parse_size(budget))
        # set before the first load's conversion and calibration too: their freed buffers go back at once
        runtime.hold_memory(config.budget_bytes)
        if config.budget_bytes is not None and config.budget_covers_process:  # refused before any work
            first_load.check(self.first_load(model, config), config.budget_bytes)
        loaded = load_lazily(model, config)
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.name, self.path = loaded.name, loaded.path
        # What a request that does not say is sampled with: the model's recommendation.
        self.default_sampling, self.sampling_source = loaded.sampling, loaded.sampling_source
        share = None  # a whole-process budget, if given
        if config.budget_bytes is not None and config.budget_covers_process:
            # Weights are not read yet (lazy load): what the process holds now besides
            # MLX is the interpreter, libraries and tokenizer; the engine gets the rest.
            share = ProcessShare(config.budget_bytes)
            config = replace(config, budget_bytes=share.remeasure(), budget_covers_process=False)
        # The budget now (a whole-process one's share changes after requests); the
        # config keeps the one at load.
        self.budget = Budget(config.budget_bytes, share)
        calibration = kv_calibration(model, config, lambda: model_identity(self, state_root(config.state_dir)))
        self.config = replace(config, kv=kv_for_model(self.model, self.model_config, config.kv, calibration))
        if self.config.kv is not None:  # refused now, whole: a pipeline's split model's probe would cross ranks
            adapter.check(self.model)
        # How requests run, once: in this process, or over `group`'s ranks (the model then
        # cut to this rank's layers, before any weight is read or counted).
        self.runner: Runner = choose_runner(self.model, self.model_config, self.config, self.budget.bytes, group)
        trained = self.model_config.get("max_position_embeddings") or 1 << 20
        self.context_limit = self.config.context_limit or trained
        self.policy: ResidencyPolicy = get_policy(choose_policy(self.model, self.model_config, self.config.policy,
                                                       self.context_limit, self.config.kv, self.budget.bytes))
        self.blas = blas.active_blas()
        budget = self.budget.bytes
        weight_limit = None
        if budget is not None:
            runtime.hold_memory(budget)
            # What the smallest request needs besides weights; the rest may hold weights.
            need = self._footprint(1, 0, 0, verify_rows=1)
            weight_limit = budget - need.total
            if not self.config.offload_weights:  # every weight resident, or nothing can run
                dtype = mx.float32 if self.policy.fp32 else None
                working, dense = predict_prefill_bytes(self.model), False  # the cheaper prefill, as edge_footprint
                one_linear = predict_working_bytes(self.model)
                if not self.config.deterministic and one_linear < working:
                    working, dense = one_linear, True
                need = self._footprint(1, predict_resident_bytes(self.model, self.policy.resident, dtype),
                                       working, chunk=MIN_PREFILL_CHUNK, dense_prefill=dense, verify_rows=1)
            if weight_limit <= 0 or need.total > budget:
                raise BudgetExceeded(need.total, budget, 0, need.positions)
        # everything that changes how mlx-lm's modules run, in its order (justfit/model/adapter.py)
        self.adapted = adapter.install(self.model, paged=self.config.kv is not None,
                                       native=self.policy.resident in NATIVE_FORMS, policy=self.policy,
                                       offload_to=offload_dir(loaded, self.policy), weight_limit=weight_limit,
                                       probe=False)  # checked above, whole
        self.swap = self.adapted.swap
        self.swap.registry.strict = budget is not None  # give freed memory back at once
        # How every token is computed (justfit.engine.numerics), unless the runner fixes it
        # (a pipeline's rank holds part of the model: nothing to check row invariance on).
        self.numerics = self.runner.numerics or numerics.choose(self.config.deterministic, self.model, self.swap,
                                                                self.new_cache, paged=self.config.kv is not None)
        if budget is None:
            runtime.hold_memory(None)  # without a budget too: freed buffers go back at once, a lower whole-process peak
        mx.clear_cache()  # the conversion's transients go back to the system, not MLX's cache
        trim_heap()  # and what converting the weights freed outside MLX
        self.load_marks = LoadMarks(before_load, loaded.tokenizer_bytes,
                                    blas_warm_up(getattr(getattr(self.model, "args", None), "hidden_size", 256)))
        c = self.config
        state_dir = state_root(c.state_dir)  # also remembers the weights' sha256 (model identity)
        total = c.state_disk if c.state_disk is not None else default_state_disk(state_dir)
        sessions_disk, anonymous_disk = split_state_disk(total)
        if c.session_disk is not None:
            sessions_disk, anonymous_disk = c.session_disk, max(0, total - c.session_disk)
        self.states = StateTiers(state_dir, state_identity(self, state_dir), len(self.new_cache()),
                                 c.state_memory if c.state_memory is not None else psutil.virtual_memory().total // 4,
                                 anonymous_disk, session_disk_limit=sessions_disk, session_keep_s=c.session_keep_s,
                                 vocab=getattr(getattr(self.model, "args", None), "vocab_size", None),  # the logits' width
                                 quarantine_limit=quarantine_limit(total, anonymous_disk))
        if c.kv_disk is not None:  # page files a killed process left (a snapshot linking one keeps its pages)
            disk_pages.sweep(c.kv_disk)
        # Queued session writes finish before the interpreter exits (the writer's thread is
        # a daemon); the engine is not kept alive for it.
        self.step_costs = StepCosts()  # decode steps' seconds by rows, measured as they run (justfit.engine.speculate)
        states = weakref.ref(self.states)
        runtime.at_exit(lambda: (t := states()) is not None and t.flush())
        # The positions each rank's own plan holds (-1: no budget), extra limits for the
        # plan search; [] for one process.
        own = self.footprint(1).max_positions(budget) if budget is not None else -1
        self.rank_limits: list[int] = self.runner.gather_limits(own)

    @staticmethod
    def first_load(model: str | None, config: EngineConfig) -> FirstLoad:
        """What loading `model` with `config` still has to do (convert, calibrate) and its
        predicted whole-process peak (justfit.model.first_load), before any work."""
        state_dir = state_root(config.state_dir)
        return first_load.predict(model, RequantOptions(bits=config.gguf_bits, embed_bits=config.gguf_embed_bits),
                                  config.kv, lambda cfg, folder: folder_identity(cfg, folder, str(model), state_dir))

    # -- prompts ---------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of text, chat messages (through the chat template) or ids."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if prompt and isinstance(prompt[0], dict):
            return self.apply_chat_template(prompt)
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`) rendered for a reply to follow."""
        return render_chat(self.tokenizer, messages, tools)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim)."""
        return attention_shape(self.model, self.model_config)

    def stored_bytes(self) -> int:
        """Size of the model's weight files on disk (0 when not a local folder)."""
        return sum(f.stat().st_size for f in weight_files(self.path))

    # -- budget ------------------------------------------------------------------
    def set_budget(self, budget: int | str) -> None:
        """Hold later requests to `budget` (e.g. once what runs beside the engine is
        known); freed memory then goes back to the system at once, as under a budget
        given at load."""
        self.budget.set(parse_size(budget))
        self.swap.registry.strict = True
        runtime.hold_memory(self.budget.bytes)

    def remeasure_outside(self, high_water: int = 0, mlx_peak: int = 0, seen: int = 0) -> None:
        """Under a whole-process budget, take what the process holds besides MLX off the
        engine's share (justfit.planning.outside.Budget.remeasure); nothing otherwise."""
        self.budget.remeasure(high_water, mlx_peak, seen)

    def remeasure_reserve(self, plan: Footprint, positions: int, mlx_peak: int, states: int = 0,
                          besides: int = 0) -> None:
        """Under a budget, after a request planned as `plan` that reached `positions`:
        measure the planner's reserve again from its MLX peak (`mlx_peak`; `states` of
        it stored states, `besides` what `mlx_besides` said when it began) against
        `plan` at those positions, at the chunk it used
        (justfit.planning.outside.Budget.remeasure_reserve)."""
        if positions > 0:
            self.budget.remeasure_reserve(plan.at(positions), mlx_peak, states, besides)

    def mlx_besides(self) -> int:
        """MLX's active bytes besides this engine's resident weights and stored states
        (another engine's, arrays a caller holds): not the engine's, though in its MLX peaks."""
        return max(0, mx.get_active_memory() - self.swap.registry.resident_bytes() - self.states.memory_bytes)

    def watch_outside(self) -> OutsideWatch | None:
        """A started watch of what the process holds besides MLX while requests run
        (under a whole-process budget; None otherwise): its `stop()` is `seen` above."""
        return self.budget.watch()

    def _footprint(self, positions: int, weights: int | None, working: int,
                   kv: KVConfig | None | str = "engine", chunk: int | None = None,
                   pressed: bool = False, dense_prefill: bool = True, disk_layers: int = 0,
                   verify_rows: int | None = None) -> Footprint:
        return footprint(self.model, self.model_config, positions, chunk or self.config.prefill_chunk,
                         self.config.kv if kv == "engine" else kv, weights, working,
                         4 if self.policy.fp32 else 2, pressed, dense_prefill,
                         limited=self.budget.bytes is not None, disk_layers=disk_layers,
                         verify_rows=self.verify_rows if verify_rows is None else verify_rows,
                         row_invariant=self.config.deterministic, reserve=self.budget.reserve)

    @property
    def verify_rows(self) -> int:
        """The most positions a decode step feeds: 1, and a draft's tokens when drafting."""
        return 1 + MAX_DRAFT if self.config.draft == "ngram" and not self.numerics.one_row else 1

    def footprint(self, positions: int, offloaded: tuple[str, ...] = (),
                  kv: KVConfig | None | str = "engine", chunk: int | None = None,
                  pressed: bool = False, dense_prefill: bool = True, disk_layers: int = 0,
                  verify_rows: int | None = None) -> Footprint:
        """Memory for `positions` retained positions with `offloaded` components on disk,
        prefilled `chunk` tokens at a time (default: the configured chunk); `kv`
        another KV configuration (None: mlx-lm's own cache) for comparisons; `pressed`:
        with pages stepped down to the last format of the pressure ladder;
        `dense_prefill` False: prefill on the resident forms, no dense working copy;
        `disk_layers`: growing layers whose pages live on disk; `verify_rows`: the most
        positions a decode step feeds (None: `verify_rows`)."""
        reg = self.swap.registry
        weights = reg.total_bytes() - sum(reg.components[n].nbytes for n in offloaded)
        return self._footprint(positions, weights, self.swap.working_bytes(offloaded, dense_prefill), kv, chunk,
                               pressed, dense_prefill, disk_layers, verify_rows)

    def edge_footprint(self, offloaded: tuple[str, ...] = (), kv: KVConfig | None | str = "engine",
                       pressed: bool = False, disk_layers: int = 0) -> Footprint:
        """`footprint` at one position, prefilled the cheapest way a tight budget's plan
        takes (the smallest chunk, on the resident forms or one dense linear at a time,
        whichever holds less; no drafts: justfit.planning.budget.plan): what a budget
        holds is its `max_positions`."""
        dense = (False, True) if not (self.numerics.deterministic or self.numerics.one_row) else (False,)
        return min((self.footprint(1, offloaded, kv, MIN_PREFILL_CHUNK, pressed, dense_prefill=d,
                                   disk_layers=disk_layers, verify_rows=1) for d in dense),
                   key=lambda fp: fp.total)

    def plan(self, positions: int) -> tuple[tuple[str, ...], Footprint]:
        """Components on disk and the footprint that fit `positions` (justfit.planning.budget.plan)."""
        return plan(self, positions)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> tuple[tuple[str, ...], Footprint]:
        """Refuse what the context or budget cannot hold, before any work; else its plan."""
        return check_fits(self, prompt_tokens, max_tokens)

    def state_allowance(self, request: Footprint) -> int | None:
        """What the budget leaves for stored states while `request` runs."""
        budget = self.budget.bytes
        return None if budget is None else max(0, budget - request.total)

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

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens of the latest conversation's state (the conversation so far)."""
        return self.runner.latest_tokens(self)

    def save_state(self, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
        """Snapshot a session's state (default: the most recent one) to `path`, KV
        pages as stored; `extra` (JSON) rides along and comes back from load_state."""
        return self.runner.export_state(self, path, extra, session)

    def load_state(self, path: str, session: str | None = None) -> StateIO:
        """Resume a snapshot (as `session`, or as the latest conversation): the next
        request extending its tokens prefills only what is new. Raises
        statetrans.SnapshotError, with nothing changed, when it cannot."""
        return self.runner.import_state(self, path, session)

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

    # -- generation --------------------------------------------------------------
    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None,
                 progress: ProgressFn | None = None, session: str | None = None, scope: str = "") -> Iterator[Chunk]:
        """Stream the reply to `prompt`, starting from the stored state sharing the
        longest prefix with it (`session`'s own first) among `scope`'s (a client's:
        another scope's states are never reused). Closing the iterator early cancels
        cleanly: the state stored then holds exactly the tokens computed."""
        tokens = self.encode(prompt)  # here, in the iterating thread, as before the first chunk
        if not tokens:
            raise ValueError("empty prompt")
        yield from self.runner.generate(self, tokens, sampling or self.default_sampling, progress, session, scope)

    def complete(self, prompt: Prompt, sampling: SamplingParams | None = None) -> str:
        """The whole reply as one string."""
        return self.reply(prompt, sampling).text

    def reply(self, prompt: Prompt, sampling: SamplingParams | None = None, session: str | None = None,
              scope: str = "") -> Reply:
        """The whole reply: text, tokens and the request's stats (see `generate`)."""
        return collect(self.generate(prompt, sampling, session=session, scope=scope))

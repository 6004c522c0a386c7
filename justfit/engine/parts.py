"""An engine's parts, built once at load: the model (its adapter installed), the budget,
the runner, the residency policy, PhaseSwap, the numerics, the stored states, the planner
and the decode steps' costs. `load_parts` builds each from the ones before it; `Parts`
holds them and is not written afterwards: what changes while requests run lives inside
its own part (the budget's measured share and reserve, the stored states, the step costs)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import psutil
from mlx_lm.models.cache import make_prompt_cache

import kvexec
from justfit import blas, runtime
from justfit.config import EngineConfig
from justfit.engine import numerics
from justfit.engine.draft import MAX_DRAFT
from justfit.engine.grammar import Grammars
from justfit.engine.numerics import Numerics
from justfit.engine.runner import Runner, choose_runner
from justfit.engine.speculate import StepCosts
from justfit.engine.state_io import folder_identity, state_identity, state_root
from justfit.errors import BudgetExceeded
from justfit.memory import parse_size, trim_heap
from justfit.model import adapter, first_load
from justfit.model.adapter import Adapted
from justfit.model.first_load import FirstLoad
from justfit.model.gguf.cache import RequantOptions
from justfit.model.loader import kv_calibration, kv_for_model, load_lazily, offload_dir
from justfit.model.models import LoadedModel
from justfit.planning.breakdown import LoadMarks, blas_warm_up, outside_anon
from justfit.planning.budget import Budget, ProcessShare
from justfit.planning.cost_model import MIN_PREFILL_CHUNK, footprint
from justfit.planning.plan import Costs, Planner
from kvexec import KVConfig, disk_pages
from phaseswap import PhaseSwap
from phaseswap.policy import ResidencyPolicy, default_policy, get_policy
from phaseswap.predict import NATIVE_FORMS, predict_prefill_bytes, predict_resident_bytes, predict_working_bytes
from statetrans import StateTiers
from statetrans.quota import default_state_disk, quarantine_limit, split_state_disk


@dataclass(frozen=True)
class Parts:
    """What an engine is made of (see the module's docstring)."""

    loaded: LoadedModel  # the module (adapted in place), tokenizer, config, name, folder, default sampling
    # The engine's own settings: a budget given at load, a whole-process budget's share
    # at load, the KV format adapted to the model (never the caller's object).
    config: EngineConfig
    budget: Budget  # the budget now (a whole-process one's share changes after requests)
    runner: Runner  # how requests run: in this process, or over a layer pipeline's ranks
    policy: ResidencyPolicy
    adapted: Adapted  # what the adapter changed in the model, PhaseSwap among it
    numerics: Numerics  # how every token is computed
    states: StateTiers
    planner: Planner
    step_costs: StepCosts  # decode steps' seconds by rows, measured as they run (justfit.engine.speculate)
    load_marks: LoadMarks  # the process's memory before and during the load (justfit.planning.breakdown)
    blas: str  # which BLAS MLX's CPU backend uses, in words
    grammars: Grammars  # compiled output constraints (justfit.engine.grammar), built as requests ask

    @property
    def swap(self) -> PhaseSwap:
        """The model's PhaseSwap: its weights' components, residency and leases."""
        return self.adapted.swap

    def reconfigured(self, config: EngineConfig | None = None, budget: Budget | None = None) -> Parts:
        """These parts planning and running requests by `config` and `budget` instead
        (None: as now), for a benchmark's replay at another prefill chunk or KV format,
        or a test's budget; the model and stored states are the same objects."""
        config = self.config if config is None else config
        budget = self.budget if budget is None else budget
        planner = replace(self.planner, costs=replace(self.planner.costs, config=config, budget=budget))
        return replace(self, config=config, budget=budget, planner=planner)


def predict_first_load(model: str | None, config: EngineConfig) -> FirstLoad:
    """What loading `model` with `config` still has to do (convert, calibrate) and its
    predicted whole-process peak (justfit.model.first_load), before any work."""
    state_dir = state_root(config.state_dir)
    return first_load.predict(model, RequantOptions(bits=config.gguf_bits, embed_bits=config.gguf_embed_bits),
                              config.kv, lambda cfg, folder: folder_identity(cfg, folder, str(model), state_dir))


def new_cache(model: nn.Module, kv: KVConfig | None) -> list:
    """Per-layer state for one sequence: KVExec pages, or mlx-lm's own caches (`kv` None)."""
    return make_prompt_cache(model) if kv is None else kvexec.make_cache(model, kv)


def choose_policy(model: nn.Module, config: dict, name: str, context: int, kv: KVConfig | None,
                  budget: int | None) -> str:
    """`name`, or for "auto" under a budget on CPU without the native kernel the
    faster weights form unless it leaves too little for `context` positions: then
    cpu-compact (the stored weights, about half of cpu's q8t bytes, a slower decode).
    With the native kernel "auto" is cpu-int16 (cpu-native without AVX2), the stored
    weights at full speed, whatever the budget. Decided from shapes, before any weight is converted."""
    if name != "auto" or budget is None or default_policy() != "cpu":
        return name
    fast = get_policy("cpu")
    weights = predict_resident_bytes(model, fast.resident, mx.float32)
    need = footprint(model, config, context, MIN_PREFILL_CHUNK, kv, weights, predict_working_bytes(model), 4)
    return fast.name if need.total <= budget else "cpu-compact"


def load_parts(model: str | None, budget: int | str | None, config: EngineConfig | None, group) -> Parts:
    """Load `model` behind `budget` (over `group`'s ranks, if any) and build every part."""
    runtime.setup()  # idempotent: the shared exec stream for this thread (and OpenBLAS, if still in time)
    before_load = outside_anon()  # the interpreter and modules: the breakdown's first measured part
    config = config or EngineConfig()
    if budget is not None:
        config = replace(config, budget_bytes=parse_size(budget))
    # set before the first load's conversion and calibration too: their freed buffers go back at once
    runtime.hold_memory(config.budget_bytes)
    if config.budget_bytes is not None and config.budget_covers_process:  # refused before any work
        first_load.check(predict_first_load(model, config), config.budget_bytes)
    loaded = load_lazily(model, config)
    grammars = Grammars(loaded.tokenizer, _vocab_size(loaded), config.grammar_cache_bytes)
    config, budget_now = _budget(config, grammars)
    calibration = kv_calibration(model, config, lambda: folder_identity(loaded.config, loaded.path, loaded.name,
                                                                        state_root(config.state_dir)))
    config = replace(config, kv=kv_for_model(loaded.model, loaded.config, config.kv, calibration))
    if config.kv is not None:  # refused now, whole: a pipeline's split model's probe would cross ranks
        adapter.check(loaded.model)
    # How requests run, once: in this process, or over `group`'s ranks (the model then
    # cut to this rank's layers, before any weight is read or counted).
    runner = choose_runner(loaded.model, loaded.config, config, budget_now.bytes, group)
    context_limit = config.context_limit or loaded.config.get("max_position_embeddings") or 1 << 20
    policy = get_policy(choose_policy(loaded.model, loaded.config, config.policy, context_limit, config.kv,
                                      budget_now.bytes))
    blas_name = blas.active_blas()
    costs = Costs(loaded.model, loaded.config, config, 4 if policy.fp32 else 2, budget_now)
    adapted = _adapt(loaded, config, policy, costs)
    # How every token is computed (justfit.engine.numerics), unless the runner fixes it
    # (a pipeline's rank holds part of the model: nothing to check row invariance on).
    chosen = runner.numerics or numerics.choose(config.deterministic, loaded.model, adapted.swap,
                                                lambda: new_cache(loaded.model, config.kv), paged=config.kv is not None)
    if budget_now.bytes is None:
        runtime.hold_memory(None)  # without a budget too: freed buffers go back at once, a lower whole-process peak
    mx.clear_cache()  # the conversion's transients go back to the system, not MLX's cache
    trim_heap()  # and what converting the weights freed outside MLX
    marks = LoadMarks(before_load, loaded.tokenizer_bytes,
                      blas_warm_up(getattr(getattr(loaded.model, "args", None), "hidden_size", 256)))
    states = _states(loaded, config, policy)
    planner = Planner(costs, adapted.swap, states, chosen.one_row, chosen.deterministic, context_limit, MAX_DRAFT)
    # The positions each rank's own plan holds (-1: no budget), extra limits for the plan search.
    own = planner.footprint(1).max_positions(budget_now.bytes) if budget_now.bytes is not None else -1
    planner = replace(planner, rank_limits=tuple(runner.gather_limits(own)))
    return Parts(loaded, config, budget_now, runner, policy, adapted, chosen, states, planner, StepCosts(), marks,
                 blas_name, grammars)


def _vocab_size(loaded: LoadedModel) -> int:
    """The logits' width: the model's vocabulary (its embedding may be padded past the tokenizer's)."""
    size = loaded.config.get("vocab_size") or getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    return int(size or len(loaded.tokenizer))


def _budget(config: EngineConfig, grammars: Grammars) -> tuple[EngineConfig, Budget]:
    """The budget part, and the config holding the engine's budget at load: under a
    whole-process budget, the share left once what the process holds besides MLX is
    measured (weights are not read yet, a lazy load: the interpreter, libraries and
    tokenizer) and what constrained output may come to hold is set aside (the grammar
    cache's bound and tokenizer: `grammars.bound_bytes`); the share changes inside the
    budget after requests."""
    if config.budget_bytes is None or not config.budget_covers_process:
        return config, Budget(config.budget_bytes)
    share = ProcessShare(config.budget_bytes, held_back=grammars.bound_bytes,
                         holding=lambda: grammars.resident_bytes)
    config = replace(config, budget_bytes=share.remeasure(), budget_covers_process=False)
    return config, Budget(config.budget_bytes, share)


def _adapt(loaded: LoadedModel, config: EngineConfig, policy: ResidencyPolicy, costs: Costs) -> Adapted:
    """Everything that changes how mlx-lm's modules run, in its order (justfit/model/adapter.py),
    with PhaseSwap's resident weights held to what the budget leaves the smallest request."""
    budget = costs.budget.bytes
    weight_limit = None
    if budget is not None:
        runtime.hold_memory(budget)
        weight_limit = _weight_limit(loaded.model, config, policy, costs)
    adapted = adapter.install(loaded.model, paged=config.kv is not None, native=policy.resident in NATIVE_FORMS,
                              policy=policy, offload_to=offload_dir(loaded, policy), weight_limit=weight_limit,
                              probe=False)  # checked by the loader, whole
    adapted.swap.registry.strict = budget is not None  # give freed memory back at once
    return adapted


def _weight_limit(model: nn.Module, config: EngineConfig, policy: ResidencyPolicy, costs: Costs) -> int:
    """What the budget leaves for resident weights beside the smallest request; refused
    (BudgetExceeded) when nothing can run, every weight resident unless offloading."""
    budget = costs.budget.bytes
    need = costs.footprint(1, 0, 0, verify_rows=1)
    weight_limit = budget - need.total
    if not config.offload_weights:  # every weight resident, or nothing can run
        dtype = mx.float32 if policy.fp32 else None
        working, dense = predict_prefill_bytes(model), False  # the cheaper prefill, as Planner.edge_footprint
        one_linear = predict_working_bytes(model)
        if not config.deterministic and one_linear < working:
            working, dense = one_linear, True
        need = costs.footprint(1, predict_resident_bytes(model, policy.resident, dtype), working, verify_rows=1,
                               chunk=MIN_PREFILL_CHUNK, dense_prefill=dense)
    if weight_limit <= 0 or need.total > budget:
        raise BudgetExceeded(need.total, budget, 0, need.positions)
    return weight_limit


def _states(loaded: LoadedModel, config: EngineConfig, policy: ResidencyPolicy) -> StateTiers:
    """The stored states' tiers, sized from the settings; queued session writes finish
    before the interpreter exits (the writer's thread is a daemon), the tiers not kept alive for it."""
    c = config
    state_dir = state_root(c.state_dir)  # also remembers the weights' sha256 (model identity)
    total = c.state_disk if c.state_disk is not None else default_state_disk(state_dir)
    sessions_disk, anonymous_disk = split_state_disk(total)
    if c.session_disk is not None:
        sessions_disk, anonymous_disk = c.session_disk, max(0, total - c.session_disk)
    states = StateTiers(state_dir, state_identity(loaded, c.kv, policy.name, state_dir),
                        len(new_cache(loaded.model, c.kv)),
                        c.state_memory if c.state_memory is not None else psutil.virtual_memory().total // 4,
                        anonymous_disk, session_disk_limit=sessions_disk, session_keep_s=c.session_keep_s,
                        vocab=getattr(getattr(loaded.model, "args", None), "vocab_size", None),  # the logits' width
                        quarantine_limit=quarantine_limit(total, anonymous_disk))
    if c.kv_disk is not None:  # page files a killed process left (a snapshot linking one keeps its pages)
        disk_pages.sweep(c.kv_disk)
    tiers = weakref.ref(states)
    runtime.at_exit(lambda: (t := tiers()) is not None and t.flush())
    return states

"""One capacity run in its own process (`python -m bench.capacity --worker SYSTEM ...`):
prints a `setup` JSON line (what this process runs: dtypes, BLAS, shapes, the memory
it holds before the first step), one line per completed step, then {"end": reason}."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace


class Peak(threading.Thread):
    """Samples this process's RSS; exits the process (status 3) past the budget. On a
    pipeline rank > 0 (`rank`), also prints each MiB its peak rises by, for the parent
    to take the largest rank's peak at each step."""

    def __init__(self, budget: int, rank: int = 0):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.budget, self.peak, self.rank = psutil.Process(), budget, 0, rank

    def run(self) -> None:
        told = 0
        while True:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            if self.rank and self.peak >= told + 2**20:
                told = self.peak
                print(json.dumps({"rank": self.rank, "peak_rss": self.peak}), flush=True)
            if self.peak > self.budget:
                print(json.dumps({"end": "budget", "peak_rss": self.peak}), flush=True)
                os._exit(3)
            time.sleep(0.01)


def _stock_setup(system: str, model: str):
    from bench.stock import STOCK, make_stock
    from justfit.planning.cost_model import footprint

    loaded, step, details = make_stock(system, model)
    setup = STOCK[system]
    shape = footprint(loaded.model, loaded.config, 1, setup.prefill_step, kv=None, act_bytes=2).shape
    kv_heads_dim = shape.kv_row // 2 // 2  # kv_heads * head_dim (K+V, 2 bytes each)
    facts = {"trained_context": loaded.config.get("max_position_embeddings"),
             "shape": {"full_layers": shape.full_layers, "kv_heads_x_head_dim": kv_heads_dim, "heads": shape.heads,
                       "hidden": shape.hidden, "intermediate": shape.intermediate, "vocab": shape.vocab},
             "weights_bytes": shape.weights}
    return loaded.tokenizer, step, details, facts


def _justfit(model: str, system: str, budget: int, retain: int, limit: int, start: int = 0):
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig
    from kvexec import FORMATS, KVConfig, get_format

    # The budget is the whole process's: the engine takes off what the interpreter,
    # libraries and tokenizer hold beside it, measured at load. "SYSTEM@N": a layer
    # pipeline over N local ranks (justfit.pipeline.launch), each rank with this budget.
    system, _, ranks = system.partition("@")
    # "SYSTEM+resident": no layer streamed from disk at the budget's edge (every weight in
    # memory, as the stock systems and llama.cpp keep theirs); refused where that needs one
    system, resident = system.removesuffix("+resident"), system.endswith("+resident")
    group = None
    if ranks:
        import mlx.core as mx

        group = mx.distributed.init()
    config = EngineConfig(context_limit=limit, budget_bytes=budget, budget_covers_process=True,
                          offload_weights=not resident)
    if system == "justfit-retention":
        config = replace(config, kv=KVConfig(max_positions=retain, pin_prompt=False))
    elif system == "justfit-lossless":  # q8c pages only: no page ever steps down
        config = replace(config, kv=KVConfig(pressure=()))
    elif system == "justfit-calibrated":  # the CLI's default pages (calibrated per model), no ladder
        config = replace(config, kv=KVConfig(format="calibrated", pressure=()))
    elif system == "justfit-default":  # the CLI's defaults: calibrated pages stepping down the ladder
        config = replace(config, kv=KVConfig(format="calibrated"))
    elif system == "justfit-disk":  # the CLI's default pages, no ladder: what the budget cannot hold goes to disk
        import tempfile

        config = replace(config, kv=KVConfig(format="calibrated", pressure=()),
                         kv_disk=tempfile.mkdtemp(prefix="justfit-bench-kv-"))
    engine = Engine(model, config=config, group=group)
    if engine.runner.rank > 0:  # a pipeline's follower
        engine.runner.follow(engine)  # until rank 0 ends (or this rank's Peak ends the run)
        os._exit(0)
    if system == "justfit-compact":  # chosen for this model's head_dim, before any request
        head_dim = engine.kv_shape[2]
        usable = [f for f in FORMATS if get_format(f).supports_head_dim(head_dim)]
        # fewest bytes per position; of equals, per-channel keys (the better fidelity)
        engine.parts = engine.parts.reconfigured(replace(engine.config, kv=KVConfig(format=min(
            usable, key=lambda f: (get_format(f).bytes_per_token(1, head_dim), not f.endswith("c"))))))
    history: list[int] = []
    last = None  # the last step's stats, from its reply

    def step(tokens: list[int], out: int) -> list[int]:
        nonlocal history, last
        if not history and start:  # the first step: positions of random KV stored straight into pages
            from bench.synthetic_state import store_random_state

            store_random_state(engine, tokens[:start])
            history, tokens = tokens[:start], tokens[start:]
        sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        reply = engine.reply(history + tokens, sp)
        got, last = reply.tokens, reply.stats
        history = history + tokens + got
        return got

    act_bytes, kv = 4 if engine.policy.fp32 else 2, engine.config.kv
    hot = f"float{8 * (act_bytes if kv is None else kv.full_bytes(act_bytes))}"

    def details() -> dict:
        """How the last step ran: prefill chunk, and paged positions per KV format
        (over all layers; several once pages stepped down under the budget)."""
        stats = last
        if stats is None:
            return {}
        return {"prefill_chunk": stats.prefill_chunk, "prefill_step": stats.prefill_chunk,
                "streamed_from_disk": list(engine.swap.offloaded),
                "kv_formats": stats.kv_formats,
                "kv_dtype": f"pages {','.join(sorted(stats.kv_formats)) or 'none yet'}, hot window {hot}",
                "planned": stats.planned_bytes, "engine_budget": engine.budget.bytes,
                "kv_disk": stats.kv_disk,
                "mlx_phase_peaks": [p.peak_bytes for p in stats.phases]}

    # what the planner says this budget holds (at its smallest prefill, pages stepping down
    # where the ladder is on): a prediction beside the measurement, never in its place
    planner = engine.planner.edge_footprint(pressed=bool(kv.pressure))
    if engine.config.kv_disk is not None:  # every growing layer's pages on disk at the budget's edge
        planner = engine.planner.edge_footprint(disk_layers=planner.shape.full_layers)
    planned = planner.max_positions(engine.budget.bytes)
    facts = {"trained_context": engine.model_config.get("max_position_embeddings"), "planned_positions": planned,
             "weights_bytes": planner.weights,
             "weights_dtype": f"{engine.policy.name}: resident {engine.swap.registry.resident_form}, "
                              f"compute {'float32' if engine.policy.fp32 else 'float16'}",
             "kv_bits": None, "kv_format": kv.format, "pressure": list(kv.pressure),
             "head_dim": engine.kv_shape[2]}
    return engine.tokenizer, step, details, facts


def run_worker(system: str, model: str, budget: int, step_tokens: int, out: int, max_positions: int,
               max_seconds: float, retain: int, fine_from: int = 0, fine_step: int = 0,
               synthetic: int = 0) -> None:
    """Prints one JSON line per completed step, then {"end": reason}. `synthetic`: the first
    step begins with that many positions of random keys and values stored straight into
    pages (JustFit systems; no prefill: the memory of a long context without the hours
    its prefill takes here)."""
    if system.startswith("justfit"):
        from justfit import runtime

        runtime.setup()  # OpenBLAS before mlx.core (bench.capacity already did, when it started us)
    import mlx.core as mx

    from bench.common import prompt_tokens
    from justfit.blas import active_blas
    from justfit.errors import JustFitError, PipelineLost
    from justfit.memory import peak_rss_bytes

    sampler = Peak(budget, int(os.environ.get("MLX_RANK", "0")))
    sampler.start()
    if system.startswith("justfit"):
        tokenizer, step, details, facts = _justfit(model, system, budget, retain, max_positions + out + 1, synthetic)
        facts["synthetic_start"] = synthetic
    else:
        tokenizer, step, details, facts = _stock_setup(system, model)
    text = prompt_tokens(tokenizer, max_positions)
    import psutil

    print(json.dumps({"setup": {**facts, "blas": active_blas(), "baseline_rss": psutil.Process().memory_info().rss,
                                "pid": os.getpid()}}), flush=True)
    fed = generated = 0
    pending: list[int] = []  # the last generated token: fed with the next step
    start = time.perf_counter()
    while True:
        size = fine_step if fine_from and fed + generated >= fine_from else step_tokens
        size += synthetic if not fed else 0
        if fed + generated + size + out > max_positions:
            break
        if time.perf_counter() - start > max_seconds:
            print(json.dumps({"end": "time limit"}), flush=True)
            return
        t0 = time.perf_counter()
        try:
            got = step(pending + text[fed:fed + size], out)
        except JustFitError as e:
            # a pipeline rank gone: its own Peak ended it past the budget (its line says so)
            lost = isinstance(e, PipelineLost)
            print(json.dumps({"end": "budget" if lost else "planner refused", "reason": str(e)}), flush=True)
            return
        fed, generated = fed + size, generated + len(got)
        pending = got[-1:]
        peak = max(sampler.peak, peak_rss_bytes())
        print(json.dumps({"positions": fed + generated, "input": fed, "generated": generated,
                          "peak_rss": peak, "mlx_peak": mx.get_peak_memory(),
                          "step_s": round(time.perf_counter() - t0, 2), **details()}), flush=True)
        if peak > budget:
            print(json.dumps({"end": "budget", "peak_rss": peak}), flush=True)
            return
    print(json.dumps({"end": "position limit"}), flush=True)

"""The runner of a layer pipeline (justfit.pipeline.layers), chosen once at load
(justfit.engine.runner) behind the interface of one process's: rank 0 runs each request
as a Sequence on the scheduler's step loop, one at a time (max_batch 1, no drafts: its
numerics), its state resumed from and left in what every rank keeps (`PipelineStates`),
a request that stops moving bounded by a watch (justfit.pipeline.stall), a peer gone
turned into PipelineLost for it and every later request; ranks > 0 `follow`. Named
sessions are one process's stored states: a pipeline refuses them, and saves and
restores the conversation every rank holds instead (justfit.pipeline.state)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator

import mlx.core as mx

from justfit.config import SamplingParams
from justfit.engine.generate import ProgressFn
from justfit.engine.numerics import Numerics
from justfit.engine.scheduler import generate_here
from justfit.engine.state_io import StateIO
from justfit.engine.stats import Chunk
from justfit.errors import PipelineLost
from justfit.pipeline import state as pipeline_state
from justfit.pipeline.layers import STOP, Pipeline, PipelineRun, control, follow, gather, resume
from justfit.pipeline.stall import StallWatch
from justfit.planning.cost_model import Footprint
from statetrans import Reuse, snapshot_bytes

SESSIONS_REFUSED = ("named sessions are kept by one process, not by a layer pipeline; send the request "
                    "without a session (every rank keeps the latest conversation) or save it to a folder "
                    "(chat: /save ./FOLDER; Engine.save_state(path))")


@dataclass(frozen=True)
class PipelineStates:
    """A pipeline's state source (justfit.engine.state_source): the state every rank
    still holds (`run.live`; stored states are one process's), its pages given the whole
    budget's slack (a pipeline runs one request at a time), and a peer gone turned
    into PipelineLost, the pipeline marked lost."""

    pipeline: Pipeline
    run: PipelineRun

    def take(self, tokens: list[int], session: str | None, allowance: int | None, scope: str) -> Reuse:
        """What every rank still holds, where it begins `tokens`; else every rank resets."""
        if self.run.lost:
            raise PipelineLost(self.run.lost)
        reuse, self.run.live = resume(self.pipeline.link, self.run.live, tokens), None
        return reuse

    def put(self, tokens: list[int], cache: list, session: str | None, rng: dict, scope: str, base: int):
        """Kept on every rank as the live state (no session is written)."""
        self.run.live = (list(tokens), cache, rng)
        return None

    def page_room(self, plan: Footprint, budget: int | None) -> int | None:
        """The plan's pages and what the budget leaves over: it runs alone."""
        return None if budget is None else plan.page_allowance(budget)

    def failure(self, error: Exception) -> Exception:
        """PipelineLost where a peer closed its doorbell or MLX's ring; else `error`."""
        if not (isinstance(error, ConnectionError) or (isinstance(error, RuntimeError) and "[ring]" in str(error))):
            return error
        self.run.lost = self.run.lost or str(error)
        lost = PipelineLost(self.run.lost)
        lost.__cause__ = error
        return lost


@dataclass
class PipelineRunner:
    """This process's part of a layer pipeline: rank 0 runs the requests, ranks > 0
    `follow` it. `run` keeps what rank 0 holds between requests (the live state, and
    why the pipeline stopped); `lost` is non-empty once it has."""

    kind: ClassVar[str] = "a layer pipeline"
    max_batch: ClassVar[int] = 1  # one request at a time: the ranks hold one live state
    numerics: ClassVar[Numerics] = Numerics("fast", "a layer pipeline promises no row invariance")
    # A forward left midway on rank 0 leaves the other ranks mid-transfer: the ranks'
    # next messages would pair with the wrong forward.
    interruptible: ClassVar[bool] = False

    pipeline: Pipeline
    run: PipelineRun = field(default_factory=PipelineRun)

    @property
    def rank(self) -> int:
        """This process's rank (0 serves)."""
        return self.pipeline.rank

    @property
    def role(self) -> str:
        """What this rank computes, for the command line."""
        return f"layers {list(self.pipeline.split.layers(self.rank))} of the pipeline; rank 0 serves"

    @property
    def lost(self) -> str:
        """Why the pipeline stopped ("" while it runs): nothing runs until every rank restarts."""
        return self.run.lost

    def gather_limits(self, own: int) -> list[int]:
        """Every rank's `own` (the positions its plan holds; -1: no budget), in rank
        order: each rank calls it at load, so rank 0 refuses before any work."""
        return gather(self.pipeline.group, own)

    def generate(self, engine, tokens: list[int], sp: SamplingParams,
                 progress: ProgressFn | None = None, session: str | None = None,
                 scope: str = "") -> Iterator[Chunk]:
        """Stream the reply to `tokens` (see Engine.generate); a peer gone marks the
        pipeline lost and raises PipelineLost, as does every request after it."""
        if self.run.lost:
            raise PipelineLost(self.run.lost)
        self.refuse_session(session)
        yield from generate_here(engine, tokens, sp, progress, session, scope)

    def states(self, engine) -> PipelineStates:
        """Where rank 0's sequences resume from and leave their state: what every rank keeps."""
        return PipelineStates(self.pipeline, self.run)

    def watch(self, sched, stall_s: float) -> StallWatch:
        """A started watch that fails `sched`'s requests and marks the pipeline lost
        once the running one has sent nothing for `stall_s` (justfit.pipeline.stall)."""
        watch = StallWatch(sched, self.run, stall_s)
        watch.start()
        return watch

    def health(self) -> dict:
        """What /health adds: the ranks and why the pipeline stopped, if it has."""
        return {"pipeline": {"ranks": self.pipeline.size, "lost": self.run.lost or None}}

    def refuse_session(self, session: str | None) -> None:
        """Named sessions are one process's state tiers: ValueError when one is named."""
        if session:
            raise ValueError(SESSIONS_REFUSED)

    def follow(self, engine, limit: int = 0) -> None:
        """On ranks > 0: compute this rank's layers of `engine` for every forward rank 0
        drives, until it stops (justfit.pipeline.layers.follow; `limit`: at most that many
        forwards, for tests of a lost rank)."""
        if self.rank == 0:
            raise RuntimeError("follow() is for ranks > 0 of a pipeline")
        pipeline = self.pipeline
        follow(engine.model, pipeline.link, engine.new_cache, engine.model.args.hidden_size,
               mx.float32 if engine.policy.fp32 else mx.float16, limit, phase=engine.swap.phase,
               on_state=lambda op, payload, cache: pipeline_state.follower_op(pipeline, engine.new_cache, op,
                                                                              payload, cache))

    def latest_tokens(self, engine) -> list[int]:
        """The tokens of the state every rank keeps (stored states are one process's)."""
        return list(self.run.live[0]) if self.run.live else []

    def close(self) -> None:
        """On rank 0, once: tell the other ranks to leave (the pipeline's STOP); nothing
        to tell when the group is lost (a rank gone) or from another rank."""
        if self.rank != 0 or self.run.lost:
            return
        try:
            control(self.pipeline.link, STOP)
        except (OSError, RuntimeError):  # a rank went meanwhile: it needs no telling
            pass
        self.run.lost = "the pipeline was stopped"

    def export_state(self, engine, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
        """Save the conversation every rank holds at `path`, one part per rank
        (justfit.pipeline.state)."""
        self.refuse_session(session)
        start = time.perf_counter()
        written, held = pipeline_state.save(self.pipeline, self.run, path,
                                            {**engine.states.identity, "extra": extra or {}})
        return StateIO(str(path), len(self.run.live[0]), held, written, time.perf_counter() - start)

    def import_state(self, engine, path: str, session: str | None = None) -> StateIO:
        """Restore the conversation saved at `path` on every rank or on none."""
        start = time.perf_counter()
        self.refuse_session(session)
        manifest, held = pipeline_state.load(self.pipeline, self.run, engine.new_cache, path, engine.states.identity)
        return StateIO(str(path), manifest["positions"], held, snapshot_bytes(Path(path).expanduser() / "rank0"),
                       time.perf_counter() - start, manifest.get("extra") or {})

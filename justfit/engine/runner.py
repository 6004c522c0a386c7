"""How an engine runs its requests, chosen once when it is built (`choose_runner`): in
one process (`LocalRunner`: every request a sequence on the scheduler's step loop,
its state in the stored states) or as this process's part of a layer pipeline
(justfit.engine.pipeline_runner: the same loop, the state every rank keeps). Both
answer the same `Runner` questions, so the engine, the scheduler and the server ask
them and never test which runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator, Protocol

from justfit.config import SamplingParams
from justfit.engine.generate import ProgressFn
from justfit.engine.numerics import Numerics
from justfit.engine.pipeline_runner import PipelineRunner
from justfit.engine.scheduler import generate_here
from justfit.engine.state_source import StateSource, StoredStates
from justfit.engine.state_io import StateIO, export_state, import_state
from justfit.engine.stats import Chunk
from justfit.pipeline.layers import attach
from justfit.planning.cost_model import MIN_PREFILL_CHUNK, footprint
from phaseswap.predict import predict_working_bytes


class Runner(Protocol):
    """What an engine's runner answers (`LocalRunner`, `PipelineRunner`)."""

    kind: str  # what it is, for messages ("one process", "a layer pipeline")
    max_batch: int | None  # the most requests it computes at once (None: as many as the budget fits)
    numerics: Numerics | None  # how it computes every token, where it fixes that (else the engine chooses)
    rank: int  # this process's rank: 0 serves requests, others follow rank 0
    role: str  # what this process computes, for the command line
    lost: str  # why it can run nothing more ("" while it can)
    interruptible: bool  # whether a forward may be abandoned midway and later requests still run

    def gather_limits(self, own: int) -> list[int]:
        """The positions every rank's plan holds, `own` this process's (at load): extra
        limits the plan search refuses by (justfit.planning.plan); [] for one process."""

    def generate(self, engine, tokens: list[int], sp: SamplingParams, progress: ProgressFn | None = None,
                 session: str | None = None, scope: str = "") -> Iterator[Chunk]:
        """Stream the reply to `tokens` on `engine` (see Engine.generate)."""

    def states(self, engine) -> StateSource:
        """Where a sequence's state comes from and goes to (justfit.engine.state_source)."""

    def watch(self, sched, stall_s: float):
        """A started watch bounding a request that stops moving (with a `stop()`), or None."""

    def health(self) -> dict:
        """What /health adds to its body."""

    def refuse_session(self, session: str | None) -> None:
        """ValueError where a named session cannot run."""

    def follow(self, engine, limit: int = 0) -> None:
        """On a rank > 0: compute this rank's share for rank 0 until it stops."""

    def latest_tokens(self, engine) -> list[int]:
        """The tokens of the latest conversation's state (what a next turn extends)."""

    def close(self) -> None:
        """As the process leaves: let whatever follows it go."""

    def export_state(self, engine, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
        """Save the latest conversation's state (or `session`'s) at `path`."""

    def import_state(self, engine, path: str, session: str | None = None) -> StateIO:
        """Restore the state saved at `path`; nothing changes on error."""


@dataclass(frozen=True)
class LocalRunner:
    """One process: a lone request is a batch of one on the step loop in the caller's
    thread, the server's worker steps one batch for every client
    (justfit.engine.scheduler); states kept in the engine's stored states."""

    kind: ClassVar[str] = "one process"
    max_batch: ClassVar[int | None] = None
    numerics: ClassVar[Numerics | None] = None
    rank: ClassVar[int] = 0
    role: ClassVar[str] = "every layer"
    lost: ClassVar[str] = ""
    interruptible: ClassVar[bool] = True

    def gather_limits(self, own: int) -> list[int]:
        """None beside the engine's own plan."""
        return []

    def generate(self, engine, tokens: list[int], sp: SamplingParams, progress: ProgressFn | None = None,
                 session: str | None = None, scope: str = "") -> Iterator[Chunk]:
        """The request as a batch of one (its plan refused here, before any work)."""
        yield from generate_here(engine, tokens, sp, progress, session, scope)

    def states(self, engine) -> StoredStates:
        """The engine's stored states (statetrans)."""
        return StoredStates(engine)

    def watch(self, sched, stall_s: float) -> None:
        """None: nothing here waits on another process."""
        return None

    def health(self) -> dict:
        """Nothing to add."""
        return {}

    def refuse_session(self, session: str | None) -> None:
        """Every session runs."""

    def follow(self, engine, limit: int = 0) -> None:
        """Nothing to follow."""
        raise RuntimeError("follow() is for ranks > 0 of a pipeline")

    def latest_tokens(self, engine) -> list[int]:
        """The most recently stored state's."""
        return list(engine.states.last.tokens) if engine.states.last else []

    def close(self) -> None:
        """Nothing follows one process."""

    def export_state(self, engine, path: str, extra: dict | None = None, session: str | None = None) -> StateIO:
        """A StateTrans snapshot of a stored state (justfit.engine.state_io)."""
        return export_state(engine, path, extra, session)

    def import_state(self, engine, path: str, session: str | None = None) -> StateIO:
        """The snapshot stored as the latest conversation or `session`'s."""
        return import_state(engine, path, session)


def choose_runner(model, model_config: dict, config, budget: int | None, group) -> Runner:
    """The runner of an engine over `model` (its `config`, an EngineConfig, and
    `budget`, this process's): one process's, or, with an mx.distributed `group` of two
    or more ranks, a layer pipeline's, `model` then cut to this rank's layers before any
    weight is read or counted (from here the planner and PhaseSwap see only them)."""
    if group is None or group.size() <= 1:
        return LocalRunner()
    base = footprint(model, model_config, 1, MIN_PREFILL_CHUNK, config.kv, 0, predict_working_bytes(model), 4)
    return PipelineRunner(attach(model, group, budget, model.args.hidden_size, base))

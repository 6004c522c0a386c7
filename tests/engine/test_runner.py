"""The runner chosen at load (justfit/engine/runner.py): the engine, the scheduler, the
server and the command line ask `engine.runner` and never test for a pipeline, so any
object answering the runner's questions drives them; a pipeline's runner answers them
without a model (its transfers faked); the pipeline's shadow ring round-trips through
mlx-lm's public cache state."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import mlx.core as mx
import pytest

from justfit.config import SamplingParams
from justfit.engine.facade import Engine
from justfit.engine.pipeline_runner import PipelineRunner
from justfit.engine.runner import LocalRunner
from justfit.engine.events import End
from justfit.engine.job import Job
from justfit.engine.scheduler import Scheduler
from justfit.errors import PipelineLost
from justfit.pipeline.layers import STOP, Pipeline, Split
from justfit.server.app import Server, ServerConfig
from justfit.server.schema import BadRequest, Options


class FakeRunner:
    """Answers the runner's questions with what a test sets, and records what it is asked."""

    kind, max_batch, numerics, rank, role = "a fake", 1, None, 0, "every layer"

    def __init__(self, lost: str = "", refuse: str = ""):
        self.lost, self.refuse, self.watched = lost, refuse, []
        self.generated = []

    def generate(self, engine, tokens, sp, progress=None, session=None, scope=""):
        self.generated.append((engine, tokens, sp, session, scope))
        yield "chunk"

    def watch(self, sched, stall_s: float):
        watch = SimpleNamespace(stall_s=stall_s, stopped=False)
        watch.stop = lambda: setattr(watch, "stopped", True)
        self.watched.append(watch)
        return watch

    def health(self) -> dict:
        return {"fake": {"lost": self.lost or None}}

    def refuse_session(self, session) -> None:
        if session and self.refuse:
            raise ValueError(self.refuse)


def test_the_scheduler_runs_its_own_loop_and_the_runners_watch():
    runner = FakeRunner()
    sched = Scheduler(SimpleNamespace(runner=runner), stall_s=7.0)
    loop = asyncio.new_event_loop()
    try:
        assert sched._thread.is_alive() and [w.stall_s for w in runner.watched] == [7.0]
        job = Job([1, 2], SamplingParams(max_tokens=1), loop)
        job.cancel.set()  # its client left while it waited: answered without the engine
        sched.submit(job)
        got = loop.run_until_complete(asyncio.wait_for(job.events.get(), 10))
        assert got == End(None) and sched.cancelled == 1
    finally:
        sched.close()
        loop.close()
    assert runner.watched[0].stopped and not sched._thread.is_alive()
    unwatched = FakeRunner()
    Scheduler(SimpleNamespace(runner=unwatched)).close()  # no stall limit: the runner is not asked
    assert unwatched.watched == []


def test_engine_generate_hands_the_request_to_its_runner():
    runner = FakeRunner()
    sp = SamplingParams(max_tokens=3)
    engine = SimpleNamespace(runner=runner, default_sampling=sp, encode=lambda prompt: [7, 8, 9])
    assert list(Engine.generate(engine, "hi", session="s", scope="k")) == ["chunk"]
    assert runner.generated == [(engine, [7, 8, 9], sp, "s", "k")]


def _server(runner) -> Server:
    engine = SimpleNamespace(runner=runner, name="fake", states=None)
    return Server(engine, ServerConfig(port=0))


def test_the_server_asks_the_runner_whether_it_is_lost_and_refuses_sessions():
    lost = _server(FakeRunner(lost="a rank went"))
    refusing = _server(FakeRunner(refuse="no sessions here"))
    try:
        with pytest.raises(BadRequest) as e:
            lost.submit([1], Options(SamplingParams(), False))
        assert e.value.status == 503 and e.value.code == "pipeline_degraded" and "a rank went" in e.value.message
        health = asyncio.run(lost.health(None))
        assert json.loads(health.text) == {"status": "degraded", "model": "fake", "fake": {"lost": "a rank went"}}
        with pytest.raises(BadRequest) as e:
            refusing.submit([1], Options(SamplingParams(), False, session="s"))
        assert e.value.status == 400 and e.value.code == "session_unsupported" and e.value.message == "no sessions here"
        assert json.loads(asyncio.run(refusing.health(None)).text)["status"] == "ok"
    finally:
        lost.close()
        refusing.close()


class _Link:
    """Rank 0's transfers to a pipeline of two, recorded (nothing is sent)."""

    def __init__(self, fail: bool = False):
        self.group = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
        self.sent, self.fail = [], fail

    def send(self, x, peer: int):
        if self.fail:
            raise ConnectionError("rank 1 is gone")
        self.sent.append((x.tolist(), peer))
        return x


def test_a_pipeline_runner_stops_its_followers_once_and_then_refuses_requests():
    link = _Link()
    runner = PipelineRunner(Pipeline(Split((0, 1, 2)), link))
    assert runner.max_batch == 1 and runner.health() == {"pipeline": {"ranks": 2, "lost": None}}
    with pytest.raises(ValueError, match="named sessions are kept by one process"):
        runner.refuse_session("s")
    runner.refuse_session(None)
    assert not runner.interruptible and runner.latest_tokens(None) == []
    runner.run.live = ([5, 6, 7], None, None)  # what every rank keeps after a request
    assert runner.latest_tokens(None) == [5, 6, 7]
    runner.close()
    runner.close()  # at exit again: nothing more to tell
    assert link.sent == [([STOP, 0], 1)] and runner.lost == "the pipeline was stopped"
    with pytest.raises(PipelineLost, match="the pipeline was stopped"):
        next(runner.generate(None, [1], SamplingParams()))
    gone = PipelineRunner(Pipeline(Split((0, 1, 2)), _Link(fail=True)))
    gone.close()  # a follower already gone needs no telling
    assert gone.lost == "the pipeline was stopped"


def test_one_process_runs_any_session_follows_nothing_and_gathers_no_limits():
    runner = LocalRunner()
    runner.refuse_session("s")
    runner.close()
    assert runner.max_batch is None and runner.lost == "" and runner.health() == {} and runner.interruptible
    assert runner.gather_limits(1234) == [] and runner.watch(None, 1.0) is None
    with pytest.raises(RuntimeError, match="ranks > 0"):
        runner.follow(None)


def test_a_window_shadow_round_trips_through_mlx_lm_s_public_cache_state():
    from mlx_lm.models.cache import RotatingKVCache

    from justfit.pipeline.stand_ins import WindowPosition

    shadow, real = WindowPosition(max_size=8, keep=0), RotatingKVCache(max_size=8)
    for n in (5, 1, 1, 1, 1, 1, 3, 1):  # a prefill, decode steps past the window, a chunk, a step
        shadow.advance(n)
        real.update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
    size, numbers = shadow.place
    assert numbers == list(real.state[2:]) and size == real.keys.shape[2]
    again = WindowPosition(max_size=8, keep=0)
    again.restore(size, numbers)
    assert again.offset == shadow.offset == real.offset and again.place == shadow.place
    for n, window in ((1, 4), (3, None)):
        mine, theirs = again.make_mask(n, window_size=window), real.make_mask(n, window_size=window)
        assert (mine == theirs if isinstance(mine, str) else mx.array_equal(mine, theirs).item())


class _Exec(Exception):
    pass


def test_ranks_relaunch_before_click_parses_and_only_for_commands_that_run_a_pipeline(monkeypatch):
    """`--ranks N` turns the process into the launcher (exec) from the entry point, not
    from a click callback; `fit --ranks` only plans, and a rank never relaunches."""
    import os
    import sys

    from cli.common import relaunch_as_ranks
    from cli.main import main

    execs = []

    def execv(path, argv):
        execs.append(argv)
        raise _Exec

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.delenv("MLX_RANK", raising=False)
    argv = ["-m", "cli.main", "serve", "--ranks", "2", "--drain", "3"]
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, *argv])
    with pytest.raises(_Exec):
        relaunch_as_ranks(main, argv[2:])
    launched = execs.pop()
    assert launched[1:7] == ["-m", "justfit.pipeline.launch", "-n", "2", "--grace", "23"]  # the drain and 20 s
    assert launched[7:] == ["--", sys.executable, "-m", "cli.main", "serve", "--drain", "3"]
    for args in (["fit", "--ranks", "2"], ["serve", "--ranks", "1"], ["generate", "--ranks", "2", "--help"]):
        relaunch_as_ranks(main, args)
    monkeypatch.setenv("MLX_RANK", "0")
    relaunch_as_ranks(main, ["serve", "--ranks", "2"])
    assert execs == []


def test_load_engine_follows_on_a_rank_above_0_and_stops_the_followers_at_exit_on_rank_0(monkeypatch):
    from cli import common
    from justfit import runtime

    at_exit = []
    monkeypatch.setattr(runtime, "at_exit", at_exit.append)
    followed = []
    follower = SimpleNamespace(rank=1, role="layers [1] of the pipeline; rank 0 serves",
                               follow=lambda engine: followed.append(engine))
    built = SimpleNamespace(runner=follower)
    monkeypatch.setattr("justfit.Engine", lambda **kwargs: built)
    assert common.load_engine(None, None) is None and followed == [built] and at_exit == []
    leader = FakeRunner()
    leader.close = lambda: None
    built = SimpleNamespace(runner=leader)
    monkeypatch.setattr("justfit.Engine", lambda **kwargs: built)
    assert common.load_engine(None, None) is built and at_exit == [leader.close]

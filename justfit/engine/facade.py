"""The engine: the public facade over one loaded model, a memory budget, and the
conversations whose computed state is kept between requests so a growing chat only
prefills what is new. Its parts are built once at load (justfit.engine.parts: the
model, the budget, the planner, the runner, the stored states...); running requests is
the runner's (justfit.engine.runner), stored states justfit.engine.state_io's and statetrans's."""

from __future__ import annotations

from typing import Iterator

from justfit import runtime
from justfit.config import EngineConfig, SamplingParams
from justfit.engine.generate import ProgressFn
from justfit.engine.parts import Parts, load_parts, new_cache, predict_first_load
from justfit.engine.state_io import StateIO, resume_session, save_session
from justfit.engine.stats import Chunk, Reply, collect
from justfit.memory import parse_size
from justfit.model.chat_template import render_chat
from justfit.model.first_load import FirstLoad
from justfit.model.models import weight_files
from justfit.planning.cost_model import attention_shape

Prompt = str | list[dict[str, str]] | list[int]


class _Part:
    """An engine attribute read from its parts (`path`: dotted from `Parts`); built
    once at load, so never set."""

    def __init__(self, path: str):
        self.path = path.split(".")

    def __get__(self, engine, owner=None):
        if engine is None:
            return self
        value = engine.parts
        for name in self.path:
            value = getattr(value, name)
        return value

    def __set__(self, engine, value) -> None:
        raise AttributeError(f"an engine's {'.'.join(self.path)} is built once at load")


class Engine:
    """A model behind a memory budget, generating from text, chat messages or tokens.

    The engine works on its own copy of `config` (never the caller's): a budget given
    here, the engine's share of a whole-process budget and the KV format adapted to the
    model are in `engine.config`. What it is made of is `engine.parts`
    (justfit.engine.parts); the attributes below read them."""

    model, tokenizer, model_config = _Part("loaded.model"), _Part("loaded.tokenizer"), _Part("loaded.config")
    name, path = _Part("loaded.name"), _Part("loaded.path")
    # What a request that does not say is sampled with: the model's recommendation.
    default_sampling, sampling_source = _Part("loaded.sampling"), _Part("loaded.sampling_source")
    config, budget, runner, policy = _Part("config"), _Part("budget"), _Part("runner"), _Part("policy")
    adapted, swap, numerics, states = _Part("adapted"), _Part("swap"), _Part("numerics"), _Part("states")
    planner, step_costs, load_marks, blas = _Part("planner"), _Part("step_costs"), _Part("load_marks"), _Part("blas")
    context_limit = _Part("planner.context_limit")
    grammars = _Part("grammars")  # compiled output constraints: `engine.grammars.check(constraint)` (justfit.engine.grammar)

    def __init__(self, model: str | None = None, budget: int | str | None = None,
                 config: EngineConfig | None = None, group=None):
        self.parts: Parts = load_parts(model, budget, config, group)

    @staticmethod
    def first_load(model: str | None, config: EngineConfig) -> FirstLoad:
        """What loading `model` with `config` still has to do (convert, calibrate) and its
        predicted whole-process peak (justfit.model.first_load), before any work."""
        return predict_first_load(model, config)

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

    # -- conversation state ------------------------------------------------------
    def new_cache(self) -> list:
        """Per-layer state for one sequence: KVExec pages, or mlx-lm's own caches."""
        return new_cache(self.model, self.config.kv)

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

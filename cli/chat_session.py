"""The interactive chat loop, `ChatSession`: it takes an engine, where its input lines
come from and where its output goes, so it runs (and is tested) without a TTY. On a
model without a chat template (or with --raw) the conversation is one growing text the
model continues as typed (cli/raw_text.py)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, TextIO

import click
from jinja2 import TemplateError

from justfit import SamplingParams
from justfit.errors import JustFitError
from justfit.memory import format_size
from justfit.model.models import describe_sampling

from . import common, raw_text
from .chat_input import read_message
from .chat_saves import Done, load_conversation, save_conversation
from .terminal import PrefillBar, deferred_sigint, line_reader, Stopped


HELP = """\
commands:
  /reset         forget the conversation
  /system [TEXT] show, or set, the system prompt (setting it starts over)
  /stats         last request's speed and memory, BLAS and PhaseSwap policy
  /save NAME     keep the conversation as the session NAME: on disk now and after every
                 later turn (justfit state ls); a path (with /) saves a state folder,
                 NAME.json the transcript only
  /load NAME     resume a session or a conversation saved with /save: from its state,
                 nothing is recomputed; from a transcript, the next turn prefills it
  /quit          leave (also Ctrl-D)
input: end a line with \\ to continue it; a \"\"\" line opens a block closed by another.
Ctrl-C stops a reply and keeps the session."""


def request_sampling(engine, max_tokens: int, seed: int | None, temperature: float | None = None,
                     top_p: float | None = None) -> SamplingParams:
    """The engine's default sampling (the model's recommendation) with what the command
    line gave instead (None: not given)."""
    given = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
    return replace(engine.default_sampling, max_tokens=max_tokens, seed=seed, **given)


def sampling_text(engine, sp: SamplingParams) -> str:
    """What a conversation samples with, and whence: "temperature 0.2, top-p 0.9
    (SmolLM2-135M-Instruct's model card)"; "(given)" where the command line changed it."""
    defaults = engine.default_sampling
    own = (sp.temperature, sp.top_p) == (defaults.temperature, defaults.top_p)
    return f"{describe_sampling(sp)} ({engine.sampling_source if own else 'given'})"


def stats_line(s) -> str:
    """After a reply: its stats' decode speed, prefill speed and peak memory, on one line."""
    if s is None:
        return ""
    parts = [f"{s.generated_tokens} tokens at {s.decode_tps:.1f} tok/s"]
    new = s.prompt_tokens - s.cached_tokens
    parts.append(f"prefill {new} at {s.prefill_tps:.0f} tok/s ({s.cached_tokens} cached)")
    if s.memory is not None:
        parts.append(f"peak {format_size(s.memory.mlx_peak)}")
    return " · ".join(parts)


def request_lines(stats) -> list[str]:
    """A request's figures: speeds, memory, and one line per phase."""
    if stats is None:
        return ["last request: none yet"]
    lines = [f"last request: {stats.summary()}"]
    if stats.memory is not None:
        lines.append(f"memory: {stats.memory.summary()}")
    return lines + [f"phase {p.summary()}" for p in stats.phases]


class ChatSession:
    """A conversation with an engine, driven line by line.

    lines: an iterable of input lines, or a `read(prompt) -> str` function that
    raises EOFError at the end (the terminal uses `input`). out: where replies go;
    err: where notices, errors, the progress bar and stats lines go (default: out).
    raw: no chat template; the conversation is one text the model continues.
    """

    def __init__(self, engine, lines: Iterable[str] | Callable[[str], str], out: TextIO,
                 err: TextIO | None = None, *, sampling: SamplingParams | None = None,
                 system: str | None = None, progress: bool = False,
                 progress_min_tokens: int = 256, show_stats: bool = True,
                 catch_interrupt: bool = True, raw: bool = False):
        self.engine = engine
        self.raw = raw
        self._kept: list[int] | None = None  # raw: the tokens of `messages`, as computed
        self.read = line_reader(lines)
        self.out, self.err = out, err or out
        # none given: the model's recommendation (no engine, as when only input is read: the fallback)
        self.sampling = sampling or (engine.default_sampling if engine is not None else SamplingParams())
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.session: str | None = None  # named by /save: every turn is written through
        self.progress, self.progress_min_tokens = progress, progress_min_tokens
        self.show_stats = show_stats
        self.catch_interrupt = catch_interrupt
        self._stop = False
        self.last_stats = None  # the stats of this session's last finished request (from its last chunk)

    # -- conversation ----------------------------------------------------------
    def prompt_messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def prompt(self) -> list[dict[str, str]] | list[int]:
        """What the engine is given for the conversation, whose last message is the
        new input: chat messages, or in raw mode the tokens of the one text."""
        if not self.raw:
            return self.prompt_messages()
        *before, last = self.messages
        kept = self._kept if self._kept is not None else raw_text.text_tokens(self.engine, before, self.system)
        previous = before[-1]["content"] if before else None
        return raw_text.next_prompt(self.engine, kept, previous, last["content"], self.system)

    def reset(self) -> None:
        self.messages, self._kept = [], None
        self.session = None  # a saved session stays as it was; this is a new conversation
        self.last_stats = None
        self.engine.reset()

    def request_stop(self) -> None:
        """Stop the reply being generated at the next token (what Ctrl-C does)."""
        self._stop = True

    def ask(self, text: str) -> str | None:
        """One turn: send `text`, stream the reply to `out`, keep both in the
        conversation. Returns the reply, or None when the engine refused the turn."""
        self.messages.append({"role": "user", "content": text})
        self._stop = False
        bar = PrefillBar(self.err, self.progress, self.progress_min_tokens)

        def on_progress(done: int, total: int) -> None:
            if self._stop:
                raise Stopped
            bar(done, total)

        prompt = self.prompt()
        pieces: list[str] = []
        ids: list[int] = []
        interrupted = False
        before = self.last_stats  # the turn's own stats replace it when its last chunk comes
        guard = deferred_sigint(self.request_stop, self.engine.runner.interruptible) if self.catch_interrupt \
            else nullcontext()
        try:
            with guard:
                interrupted = self.stream(prompt, bar, on_progress, pieces, ids)
        except Stopped:
            interrupted = True
        except KeyboardInterrupt:
            # A second Ctrl-C may land mid-step: don't trust the kept state.
            interrupted = True
            self.engine.reset()
        except (JustFitError, ValueError, TemplateError) as e:  # the last: a template's raise_exception()
            self.messages.pop()
            hint = " (/reset starts over)" if self.messages else ""
            self.error(f"{common.one_line(e)}{hint}")
            return None
        reply = "".join(pieces)
        if pieces:
            click.echo("", file=self.out)
        if interrupted:
            self.notice("[interrupted]")
        elif not reply:
            self.notice("[no reply]")
        if reply:
            self.keep_reply(prompt, reply, ids)
        else:
            self.messages.pop()  # nothing came back: forget the question too
        if self.show_stats and self.last_stats is not before:
            line = stats_line(self.last_stats)
            if line:
                self.notice(line)
        return reply

    def keep_reply(self, prompt: list[dict[str, str]] | list[int], reply: str, ids: list[int]) -> None:
        """Add the reply to the conversation (in raw mode also its tokens, as computed)."""
        self.messages.append({"role": "assistant", "content": reply})
        if self.raw:
            self._kept = list(prompt) + ids
        if self.session:  # the transcript beside the session's state, for /load
            self.engine.annotate_session(self.session, {"transcript": self.transcript()})

    def stream(self, prompt: list[dict[str, str]] | list[int], bar: PrefillBar,
               progress: Callable[[int, int], None], pieces: list[str], ids: list[int]) -> bool:
        """Generate the reply to `prompt`, echoing it to `out` and collecting its text
        in `pieces` and its tokens in `ids`; True when stopped by request_stop()."""
        gen = self.engine.generate(prompt, self.sampling, progress=progress, session=self.session)
        try:
            for chunk in gen:
                bar.clear()
                if chunk.stats is not None:  # the last chunk: the request's stats
                    self.last_stats = chunk.stats
                if chunk.token is not None:
                    ids.append(chunk.token)
                if chunk.text:
                    pieces.append(chunk.text)
                    click.echo(chunk.text, file=self.out, nl=False)
                if self._stop:
                    return True
        finally:
            gen.close()  # the engine keeps exactly the tokens it computed
            bar.clear()
        return False

    # -- input -----------------------------------------------------------------
    def read_input(self) -> str | None:
        """The next message or command (see read_message)."""
        return read_message(self.read)

    def run(self) -> None:
        """Read and answer until /quit or end of input."""
        while True:
            try:
                text = self.read_input()
            except EOFError:
                click.echo("", file=self.err)
                return
            except KeyboardInterrupt:
                self.notice("\n(/quit or Ctrl-D to leave)")
                continue
            if not self.handle(text):
                return

    def handle(self, text: str) -> bool:
        """Answer one input; False when the session should end."""
        if not text.strip():
            return True
        if text.startswith("/") and "\n" not in text:  # blocks are never commands
            return self.command(text)
        self.ask(text)
        return True

    # -- commands --------------------------------------------------------------
    def command(self, text: str) -> bool:
        name, _, arg = text.strip().partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit", "/bye"):
            return False
        if name in ("/help", "/?"):
            self.notice(HELP)
        elif name == "/reset":
            self.reset()
            self.notice("conversation cleared")
        elif name == "/system":
            if not arg:
                self.notice(f"system prompt: {self.system!r}" if self.system else
                            "no system prompt (the model's default applies)")
            else:
                self.system = arg
                self.reset()
                self.notice("system prompt set; conversation cleared")
        elif name == "/stats":
            self.notice(self.stats_text())
        elif name in ("/save", "/load"):
            verb = name[1:]
            if not arg:
                self.error(f"usage: {name} NAME")
                return True
            try:
                self.notice(self.save(arg) if verb == "save" else self.load_any(arg))
            except (OSError, ValueError) as e:
                self.error(f"cannot {verb} {arg}: {common.one_line(e)}")
        else:
            self.error(f"unknown command {name}; /help lists them")
        return True

    def stats_text(self) -> str:
        e = self.engine
        lines = [
            f"model: {e.name} · policy {e.policy.name} · KV {e.config.kv.format if e.config.kv else 'mlx-lm'}"
            f" · BLAS {e.blas}" + (" · raw text (no chat template)" if self.raw else ""),
            f"sampling: {sampling_text(e, self.sampling)}",
            f"conversation: {len(self.messages)} messages, {len(e.cached_tokens)} tokens kept "
            f"of {e.context_limit} context",
        ]
        return "\n".join(lines + request_lines(self.last_stats))

    def transcript(self) -> dict:
        return {"model": self.engine.name, "system": self.system, "messages": self.messages}

    def save(self, path: str | Path) -> str:
        """Keep the conversation as a session, a state folder or a transcript (see
        cli.chat_saves.save_conversation); returns what was done, for the user."""
        return self._continue(save_conversation(self.engine, self.transcript(), path))

    def load_any(self, path: str | Path) -> str:
        """Resume a session, a state folder or read a transcript; returns what was done."""
        return self._continue(load_conversation(self.engine, path))

    def _continue(self, done: Done) -> str:
        """Continue as a /save or /load says: its session, its conversation."""
        if done.session is not None:
            self.session = done.session
        if done.conversation is not None:
            self.system, self.messages = done.conversation
            self._kept = None  # raw mode: rebuilt from the text on the next turn
        return done.text

    # -- output ----------------------------------------------------------------
    def notice(self, text: str) -> None:
        click.echo(click.style(text, dim=True), file=self.err)

    def error(self, text: str) -> None:
        click.echo(f"error: {text}", file=self.err)

"""`justfit chat`: talk to a model in the terminal, or answer one piped question.

The interactive loop lives in `ChatSession`, which takes an engine, where its input
lines come from and where its output goes, so it runs (and is tested) without a TTY.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterable, TextIO

import click

from cli import common
from cli.terminal import PrefillBar, deferred_sigint, line_reader, Stopped, tty_reader
from justfit import SamplingParams
from justfit.errors import JustFitError
from justfit.memory import format_size

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
ROLES = ("system", "user", "assistant")

HELP = """\
commands:
  /reset         forget the conversation
  /system [TEXT] show, or set, the system prompt (setting it starts over)
  /stats         last request's speed and memory, BLAS and PhaseSwap policy
  /save NAME     save the conversation and its computed state to the folder NAME
                 (NAME.json: the transcript only)
  /load NAME     resume a conversation saved with /save: from its state, nothing is
                 recomputed; from a transcript, the next turn prefills it
  /quit          leave (also Ctrl-D)
input: end a line with \\ to continue it; a \"\"\" line opens a block closed by another.
Ctrl-C stops a reply and keeps the session."""


def stats_line(engine) -> str:
    """After a reply: decode speed, prefill speed and peak memory, on one line."""
    s = engine.last_stats
    if s is None:
        return ""
    parts = [f"{s.generated_tokens} tokens at {s.decode_tps:.1f} tok/s"]
    new = s.prompt_tokens - s.cached_tokens
    parts.append(f"prefill {new} at {s.prefill_tps:.0f} tok/s ({s.cached_tokens} cached)")
    if s.memory is not None:
        parts.append(f"peak {format_size(s.memory.mlx_peak)}")
    return " · ".join(parts)


class ChatSession:
    """A conversation with an engine, driven line by line.

    lines: an iterable of input lines, or a `read(prompt) -> str` function that
    raises EOFError at the end (the terminal uses `input`). out: where replies go;
    err: where notices, errors, the progress bar and stats lines go (default: out).
    """

    def __init__(self, engine, lines: Iterable[str] | Callable[[str], str], out: TextIO,
                 err: TextIO | None = None, *, sampling: SamplingParams | None = None,
                 system: str | None = None, progress: bool = False,
                 progress_min_tokens: int = 256, show_stats: bool = True,
                 catch_interrupt: bool = True):
        self.engine = engine
        self.read = line_reader(lines)
        self.out, self.err = out, err or out
        self.sampling = sampling or SamplingParams()
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.progress, self.progress_min_tokens = progress, progress_min_tokens
        self.show_stats = show_stats
        self.catch_interrupt = catch_interrupt
        self._stop = False

    # -- conversation ----------------------------------------------------------
    def prompt_messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def reset(self) -> None:
        self.messages = []
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

        pieces: list[str] = []
        interrupted = False
        guard = deferred_sigint(self.request_stop) if self.catch_interrupt else nullcontext()
        try:
            with guard:
                interrupted = self.stream(bar, on_progress, pieces)
        except Stopped:
            interrupted = True
        except KeyboardInterrupt:
            # A second Ctrl-C may land mid-step: don't trust the kept state.
            interrupted = True
            self.engine.reset()
        except (JustFitError, ValueError) as e:
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
            self.messages.append({"role": "assistant", "content": reply})
        else:
            self.messages.pop()  # nothing came back: forget the question too
        if self.show_stats:
            line = stats_line(self.engine)
            if line:
                self.notice(line)
        return reply

    def stream(self, bar: PrefillBar, progress: Callable[[int, int], None], pieces: list[str]) -> bool:
        """Generate the reply to the current conversation, echoing it to `out` and
        collecting it in `pieces`; True when stopped by request_stop()."""
        gen = self.engine.generate(self.prompt_messages(), self.sampling, progress=progress)
        try:
            for chunk in gen:
                bar.clear()
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
        """The next message or command; None at end of input. Handles `\\`
        continuation lines and \"\"\" blocks."""
        line = self.read(PROMPT)
        stripped = line.strip()
        if stripped.startswith(BLOCK):
            rest = stripped[len(BLOCK):]
            if rest.endswith(BLOCK):  # """one line"""
                return rest[: -len(BLOCK)]
            parts = [rest] if rest else []
            while True:
                try:
                    line = self.read(CONTINUATION)
                except EOFError:
                    break
                if line.rstrip().endswith(BLOCK):
                    last = line.rstrip()[: -len(BLOCK)]
                    if last:
                        parts.append(last)
                    break
                parts.append(line)
            return "\n".join(parts)
        if line.endswith("\\"):
            parts = [line[:-1]]
            while True:
                try:
                    line = self.read(CONTINUATION)
                except EOFError:
                    break
                if line.endswith("\\"):
                    parts.append(line[:-1])
                else:
                    parts.append(line)
                    break
            return "\n".join(parts)
        return line

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
            f" · BLAS {e.blas}",
            f"conversation: {len(self.messages)} messages, {len(e.cached_tokens)} tokens kept "
            f"of {e.context_limit} context",
        ]
        s = e.last_stats
        if s is None:
            lines.append("last request: none yet")
        else:
            lines.append(f"last request: {s.summary()}")
            if s.memory is not None:
                lines.append(f"memory: {s.memory.summary()}")
            lines += [f"phase {p.summary()}" for p in s.phases]
        return "\n".join(lines)

    def transcript(self) -> dict:
        return {"model": self.engine.name, "system": self.system, "messages": self.messages}

    def save(self, path: str | Path) -> str:
        """A transcript to NAME.json, else the engine's state (with the transcript) to
        the folder NAME; returns what was done, for the user."""
        if str(path).endswith(".json"):
            text = json.dumps(self.transcript(), indent=2, ensure_ascii=False)
            Path(path).expanduser().write_text(text + "\n", encoding="utf-8")
            return f"saved {len(self.messages)} messages to {path}"
        info = self.engine.save_state(str(path), extra={"transcript": self.transcript()})
        return (f"saved {len(self.messages)} messages and the state of {info.tokens} tokens to {path} "
                f"({info.file_bytes / 2**20:.1f} MiB)")

    def load_any(self, path: str | Path) -> str:
        """Resume a state folder or read a transcript; returns what was done."""
        if Path(path).expanduser().is_dir():
            before = (self.system, self.messages)
            info = self.engine.load_state(str(path))
            try:
                self._apply(info.extra.get("transcript"))
            except ValueError:
                self.system, self.messages = before
                raise
            return f"resumed {len(self.messages)} messages ({info.tokens} tokens of state) from {path}"
        model = self.load(path)
        note = f" (saved with model {model})" if model and model != self.engine.name else ""
        return f"loaded {len(self.messages)} messages from {path}{note}"

    def load(self, path: str | Path) -> str | None:
        """Replace the conversation with a saved transcript; returns the model it was
        saved with. The engine's kept state is left alone: the next turn reuses
        whatever prefix still matches and prefills the rest."""
        return self._apply(json.loads(Path(path).expanduser().read_text(encoding="utf-8")))

    def _apply(self, data) -> str | None:
        if isinstance(data, list):
            data = {"messages": data}
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise ValueError("not a transcript (expected an object with a 'messages' list)")
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError("'system' must be a string")
        messages = []
        for i, m in enumerate(data["messages"]):
            if (not isinstance(m, dict) or m.get("role") not in ROLES
                    or not isinstance(m.get("content"), str)):
                raise ValueError(f"message {i} needs a role ({', '.join(ROLES)}) and text content")
            if m["role"] == "system" and i == 0 and system is None:
                system = m["content"]
                continue
            messages.append({"role": m["role"], "content": m["content"]})
        self.system, self.messages = system, messages
        model = data.get("model")
        return model if isinstance(model, str) else None

    # -- output ----------------------------------------------------------------
    def notice(self, text: str) -> None:
        click.echo(click.style(text, dim=True), file=self.err)

    def error(self, text: str) -> None:
        click.echo(f"error: {text}", file=self.err)


@click.command()
@common.model_option
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Most tokens per reply.")
@click.option("--temperature", "-t", type=click.FloatRange(min=0), default=0.7, show_default=True,
              help="Sampling temperature; 0 is greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Nucleus sampling: keep the smallest token set with this much probability.")
@click.option("--seed", type=int, default=None, help="Random seed, for repeatable sampling.")
@click.option("--system", "system", default=None, metavar="TEXT", help="System prompt.")
@common.budget_option
@common.whole_process_option
@common.gguf_bits_option
@common.kv_format_option
@common.policy_option
def chat(model, max_tokens, temperature, top_p, seed, system, budget, whole_process, gguf_bits, kv_format,
         policy) -> None:
    """Chat with a model.

    In a terminal: an interactive session (/help lists its commands). With stdin
    piped: all of stdin is one question, and only the answer is printed.
    """
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                              max_tokens=max_tokens)
    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    interactive = stdin.isatty()
    if interactive:
        question = None
    else:
        question = stdin.read().strip()
        if not question:
            raise common.UserError("nothing to answer: stdin was empty")
    if interactive and stderr.isatty():
        click.echo(click.style(f"loading {model or 'smollm2'}...", dim=True), file=stderr)
    engine = common.load_engine(model, budget, gguf_bits, kv_format, policy, whole_process=whole_process)
    session = ChatSession(engine, tty_reader() if interactive else [], stdout, stderr,
                          sampling=sampling, system=system, progress=stderr.isatty(),
                          show_stats=interactive, catch_interrupt=interactive)
    if interactive:
        click.echo(click.style(
            f"{engine.name} · {engine.policy.name} · context {engine.context_limit} · "
            f"/help for commands, /quit or Ctrl-D to leave", dim=True), file=stderr)
        session.run()
        return
    answer_once(session, question)


def answer_once(session: ChatSession, question: str) -> str:
    """Piped mode: stream the reply to `question` to `out`, then a newline. Engine
    refusals propagate (the command group prints them as one `error:` line)."""
    session.messages.append({"role": "user", "content": question})
    bar = PrefillBar(session.err, session.progress, session.progress_min_tokens)
    pieces: list[str] = []
    session.stream(bar, bar, pieces)
    click.echo("", file=session.out)
    reply = "".join(pieces)
    session.messages.append({"role": "assistant", "content": reply})
    return reply

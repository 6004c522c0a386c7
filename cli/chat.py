"""`justfit chat`: talk to a model in the terminal (cli/chat_session.py holds the
loop), or answer one piped question."""

from __future__ import annotations

import contextlib
import sys

import click
from jinja2 import TemplateError

from justfit.model.chat_template import has_chat_template, read_chat_template, use_chat_template

from . import common
from .chat_session import ChatSession, request_sampling, sampling_text
from .terminal import PrefillBar, loader_notes, tty_reader


@click.command()
@common.model_option
@common.sampling_options
@click.option("--system", "system", default=None, metavar="TEXT", help="System prompt.")
@click.option("--raw", is_flag=True,
              help="No chat template: the conversation is one text the model continues as typed "
                   "(automatic for base models, which have no template).")
@click.option("--chat-template", "template_file", default=None, metavar="FILE",
              help="A Jinja chat template to use instead of the model's own (or for a base model).")
@common.deprecated_alias("--template", "template_file", "--chat-template", metavar="FILE")
@common.engine_options
def chat(model, max_tokens, temperature, top_p, seed, system, raw, template_file, budget, whole_process, gguf_bits,
         kv_format, policy, draft, kv_disk, kv_disk_limit, deterministic) -> None:
    """Chat with a model.

    In a terminal: an interactive session (/help lists its commands). With stdin
    piped: all of stdin is one question, and only the answer is printed. A model
    without a chat template (a base model) continues the text as typed. Sampling is
    the model's recommendation (shown in the banner) unless -t or --top-p says.
    """
    if raw and template_file:
        raise click.UsageError("--raw and --chat-template exclude each other")
    template = read_chat_template(template_file) if template_file else None
    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    follower = common.pipeline_follower()  # it computes its layers for rank 0's turns, reads nothing
    interactive = stdin.isatty() and not follower
    if interactive or follower:
        question = None
    else:
        question = stdin.read().strip()
        if not question:
            raise common.UserError("nothing to answer: stdin was empty")
    notes = interactive and stderr.isatty()
    if notes:
        click.echo(click.style(f"loading {model or 'smollm2'}...", dim=True), file=stderr)
    with loader_notes(stderr) if notes else contextlib.nullcontext():
        engine = common.load_engine(model, budget, gguf_bits, kv_format, policy, whole_process=whole_process,
                                    kv_disk=kv_disk, kv_disk_limit=kv_disk_limit, deterministic=deterministic,
                                    draft=draft)
    if engine is None:  # a follower rank of a layer pipeline: its layers computed, nothing to print
        return
    if template is not None:
        use_chat_template(engine.tokenizer, template, f"chat template {template_file}")
    notice = raw_notice(engine, raw)
    sampling = request_sampling(engine, max_tokens, seed, temperature, top_p)
    session = ChatSession(engine, tty_reader() if interactive else [], stdout, stderr,
                          sampling=sampling, system=system, progress=stderr.isatty(),
                          show_stats=interactive, catch_interrupt=interactive, raw=notice is not None)
    if notice and (interactive or not raw):  # a piped --raw asked for it: nothing to say
        session.notice(notice)
    if interactive:
        click.echo(click.style(
            f"{engine.name} · {engine.policy.name} · context {engine.context_limit} · "
            f"sampling {sampling_text(engine, sampling)} · /help for commands, /quit or Ctrl-D to leave",
            dim=True), file=stderr)
        session.run()
        return
    answer_once(session, question)


def raw_notice(engine, raw: bool) -> str | None:
    """What to say when the text is continued as typed (None: chat messages)."""
    if not has_chat_template(engine.tokenizer):
        return f"{engine.name} is a base model with no chat template: text is continued as typed"
    if raw:
        return "raw mode: the chat template is not used, text is continued as typed"
    return None


def answer_once(session: ChatSession, question: str) -> str:
    """Piped mode: stream the reply to `question` to `out`, then a newline. Engine
    refusals propagate (the command group prints them as one `error:` line)."""
    session.messages.append({"role": "user", "content": question})
    prompt = session.prompt()
    bar = PrefillBar(session.err, session.progress, session.progress_min_tokens)
    pieces: list[str] = []
    ids: list[int] = []
    try:
        session.stream(prompt, bar, bar, pieces, ids)
    except TemplateError as e:  # e.g. a template that takes no system prompt
        raise common.UserError(f"the chat template rejected the conversation: {common.one_line(e)}") from e
    click.echo("", file=session.out)
    reply = "".join(pieces)
    session.keep_reply(prompt, reply, ids)
    return reply

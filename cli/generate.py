"""`justfit generate`: continue a text once, with no chat template: the natural command
for base models and scripts. Only the continuation is printed."""

from __future__ import annotations

import sys

import click

from . import common
from .chat_session import request_lines, request_sampling, sampling_text
from .terminal import PrefillBar


def prompt_text(prompt: str | None, stdin) -> str:
    """The text to continue: --prompt as given, else all of piped stdin less the line
    break(s) it ends with (what `echo` adds)."""
    if prompt is None:
        if stdin.isatty():
            raise common.UserError("give the text with --prompt TEXT, or pipe it on stdin")
        prompt = stdin.read().rstrip("\r\n")
    if not prompt.strip():
        raise common.UserError("nothing to continue: the prompt is empty")
    return prompt


@click.command()
@common.model_option
@click.option("--prompt", "-p", default=None, metavar="TEXT", help="The text to continue (default: stdin).")
@common.sampling_options
@click.option("--stats", "show_stats", is_flag=True, help="Print the request's phase figures to stderr.")
@common.engine_options
def generate(model, prompt, max_tokens, temperature, top_p, seed, show_stats, budget, whole_process, gguf_bits,
             kv_format, policy, draft, kv_disk, kv_disk_limit, deterministic) -> None:
    """Continue a text, as typed: no chat template, the prompt is not repeated.

    Only the continuation goes to stdout (a final newline only on a terminal), so
    `justfit generate ... > out.txt` holds exactly what the model wrote. Sampling is
    the model's recommendation unless -t or --top-p says.
    """
    text = None if common.pipeline_follower() else prompt_text(prompt, sys.stdin)  # rank 0 reads the text
    engine = common.load_engine(model, budget, gguf_bits, kv_format, policy, whole_process=whole_process,
                                kv_disk=kv_disk, kv_disk_limit=kv_disk_limit, deterministic=deterministic,
                                draft=draft)
    if engine is None:  # a follower rank of a layer pipeline: its layers computed, nothing to print
        return
    sampling = request_sampling(engine, max_tokens, seed, temperature, top_p)
    out, err = sys.stdout, sys.stderr
    bar = PrefillBar(err, err.isatty())
    gen = engine.generate(text, sampling, progress=bar)
    stats = None  # the request's, from the last chunk
    try:
        for chunk in gen:
            bar.clear()
            stats = chunk.stats or stats
            click.echo(chunk.text, file=out, nl=False)
            out.flush()
    finally:
        gen.close()
        bar.clear()
    if out.isatty():
        click.echo("", file=out)
    if show_stats:
        click.echo("\n".join([f"sampling: {sampling_text(engine, sampling)}", *request_lines(stats)]),
                   file=err)

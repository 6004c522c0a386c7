"""`justfit serve`: OpenAI-, Ollama- and Anthropic-compatible HTTP endpoints on one model."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

import click

from . import common


# Requests a server computes at once by default: admission by the planner keeps the
# batch within the budget; beyond a few rows a CPU gains little (docs/SERVING.md).
AUTO_MAX_BATCH = 4


def _batch(value: str) -> int | None:
    """--max-batch: a count >= 1, or None for auto."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a count nor 'auto'") from None
    if n < 1:
        raise click.BadParameter("must be at least 1")
    return n


@click.command()
@common.model_option
@common.budget_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback exposes the model to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@common.deprecated_alias("-p", "port", "--port (-p is --prompt elsewhere)", type=click.IntRange(0, 65535))
@click.option("--api-key", multiple=True, envvar="JUSTFIT_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health; "
                   "repeat for several keys, each with its own sessions and cache (env JUSTFIT_API_KEY, "
                   "several separated by spaces).")
@click.option("--api-keys", "api_keys_file", default=None, metavar="FILE",
              help="More keys, one a line ('#' starts a comment line); unreadable or empty: an error.")
@click.option("--cors-origin", default=None, metavar="ORIGIN",
              help="Allow browser pages from ORIGIN (e.g. http://localhost:3000, or *). Off by default.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=10, show_default=True, metavar="SECONDS",
              help="A connection whose request line and headers are not all in within this is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=30, show_default=True, metavar="SECONDS",
              help="A request whose body is not all in within this, once its headers are, gets 408 and is closed.")
@click.option("--write-timeout", type=click.FloatRange(min=0.1), default=60, show_default=True, metavar="SECONDS",
              help="A client that takes none of a response (a stream included) for this long is dropped; its "
                   "request is cancelled and its state stored, as when a client hangs up.")
@click.option("--drain", type=click.FloatRange(min=0), default=10, show_default=True, metavar="SECONDS",
              help="On SIGTERM, SIGINT or SIGHUP: stop accepting, give running requests this long to finish, "
                   "cancel the rest (their state kept), publish every session write, exit 0.")
@click.option("--state-disk", default=None, metavar="SIZE",
              help="Stored states on disk at most: named sessions 3/4 of it (least recently used go first), "
                   "the prefix cache the rest, quarantined files (at most 1/20) included; with API keys, each "
                   "key an equal share of both. Default: the smaller of 20GiB and half the free space.")
@click.option("--session-keep", type=click.FloatRange(min=0), default=10, show_default=True, metavar="MINUTES",
              help="A session used this recently is evicted by the disk quota only when nothing older is "
                   "left, and the response that evicts it says so.")
@click.option("--responses-keep", type=click.IntRange(min=1), default=1000, show_default=True, metavar="N",
              help="Responses API: stored responses kept per API key (the oldest go first).")
@click.option("--responses-disk", default="256MiB", show_default=True, metavar="SIZE",
              help="Responses API: bytes of stored responses per API key (the oldest go first).")
@click.option("--responses-days", type=click.FloatRange(min=0.001), default=30, show_default=True, metavar="DAYS",
              help="Responses API: a stored response older than this is gone.")
@click.option("--max-connections", type=click.IntRange(min=1), default=256, show_default=True, metavar="N",
              help="Open connections at most; past it a new one closes the oldest not being answered "
                   "(stalled first, then idle), so slow clients never lock others out.")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests that may wait while one computes; past it: 503 with Retry-After.")
@click.option("--max-batch", default="auto", show_default=True, metavar="N|auto", callback=lambda c, p, v: _batch(v),
              help="Requests computed at once: decode steps shared, a long prompt's prefill chunks "
                   "interleaved with the others' steps, admitted while they fit the budget together; "
                   f"auto: {AUTO_MAX_BATCH} (1 on a layer pipeline); 1: strictly one at a time.")
@click.option("--preempt/--no-preempt", default=True, show_default=True,
              help="With --max-batch: count each request at what it holds now and, when the batch outgrows "
                   "the budget, set the newest aside on disk (exact state, resumed later); --no-preempt "
                   "counts each at its full length and never sets one aside.")
@click.option("--max-body", default="16MiB", show_default=True, metavar="SIZE",
              help="Largest request body; larger ones get 413.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Reply length when a request does not say (shrunk to what fits).")
@click.option("--served-name", default=None, metavar="NAME", help="Model id clients use (default: the model's name).")
@click.option("--chat-template", "chat_template", default=None, metavar="FILE",
              help="A Jinja chat template for the chat routes, instead of the model's own; a model "
                   "with none (a base model) answers chat requests 400 without it.")
@click.option("--rank-timeout", type=click.FloatRange(min=1), default=300, show_default=True, metavar="SECONDS",
              help="Under mlx.launch: a request whose pipeline sends nothing for this long (a prefill chunk, a "
                   "token) fails with 503, and the group is reported degraded until every rank is restarted.")
@common.whole_process_option
@common.gguf_bits_option
@common.kv_format_option
@common.policy_option
@common.draft_option
@common.kv_disk_options
@common.ranks_option
def serve(model, budget, host, port, api_key, cors_origin, max_queue, max_batch, preempt, max_body, max_tokens, served_name,
          chat_template, rank_timeout, whole_process, gguf_bits, kv_format, policy, draft, kv_disk, kv_disk_limit,
          deterministic, api_keys_file, header_timeout, body_timeout, max_connections, drain, state_disk,
          session_keep, write_timeout, responses_keep, responses_disk, responses_days) -> None:
    """Serve a model over HTTP: /v1 (OpenAI, the Responses API too), /api (Ollama) and /v1/messages (Anthropic).

    Stored conversation states are reused across requests; a request that cannot
    fit the context or the budget gets HTTP 400 (context_length_exceeded) before
    any work. A request that does not say how to sample gets the model's recommended
    sampling. GET /health, /metrics (Prometheus) and /v1/justfit/status report; the
    status page is at /.
    """
    from justfit.model.chat_template import has_chat_template, read_chat_template, use_chat_template
    from justfit.memory import parse_size
    from justfit.server import ServerConfig, run
    from justfit.server.responses_store import StoreLimits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_keys = _api_keys(api_key, api_keys_file)  # a bad key file fails before loading
    config = ServerConfig(host=host, port=port, api_keys=api_keys, cors_origin=cors_origin, max_queue=max_queue,
                          max_batch=max_batch or 1, preempt=preempt,
                          max_body_bytes=parse_size(max_body), default_max_tokens=max_tokens,
                          model_name=served_name, rank_timeout_s=rank_timeout,
                          header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                          write_timeout_s=write_timeout, max_connections=max_connections, drain_s=drain,
                          responses=StoreLimits(responses_keep, parse_size(responses_disk), responses_days * 86400))
    template = read_chat_template(chat_template) if chat_template else None  # a bad file fails before loading
    click.echo(f"loading {model or 'smollm2'}...", file=sys.stderr)
    engine = common.load_engine(model, budget, gguf_bits, kv_format, policy, whole_process=whole_process,
                                state_disk=parse_size(state_disk) if state_disk else None,
                                session_keep_s=session_keep * 60, kv_disk=kv_disk, kv_disk_limit=kv_disk_limit,
                                deterministic=deterministic, draft=draft)
    if engine is None:  # a follower rank of a layer pipeline: its layers computed, nothing to serve
        return
    limit = engine.runner.max_batch  # None: as many as the budget fits
    if max_batch is None:
        max_batch = AUTO_MAX_BATCH if limit is None else min(AUTO_MAX_BATCH, limit)
    if limit is not None and max_batch > limit:
        raise click.UsageError(f"--max-batch above {limit} does not run on {engine.runner.kind} yet")
    config = replace(config, max_batch=max_batch)
    if template is not None:
        use_chat_template(engine.tokenizer, template, f"chat template {chat_template}")
    name = served_name or engine.name

    def ready(url: str) -> None:
        from justfit.model.models import describe_sampling

        click.echo(f"serving {name} on {url}/v1 (OpenAI), {url}/api (Ollama) and {url}/v1/messages (Anthropic), "
                   f"the status page at {url}/; Ctrl-C stops", file=sys.stderr)
        click.echo(f"requests that do not say are sampled at {describe_sampling(engine.default_sampling)} "
                   f"({engine.sampling_source})", file=sys.stderr)
        if host not in ("127.0.0.1", "localhost", "::1") and not config.api_keys:
            click.echo("warning: listening beyond this machine without --api-key", file=sys.stderr)
        if not has_chat_template(engine.tokenizer):
            click.echo(f"note: {name} is a base model with no chat template: chat routes answer 400; "
                       "send text to /v1/completions or /api/generate, or give --chat-template FILE", file=sys.stderr)

    run(engine, config, ready)


def _api_keys(given: tuple[str, ...], file: str | None) -> tuple[str, ...]:
    """The keys of --api-key and --api-keys FILE, checked; a clear error before loading anything."""
    from justfit.server import keys

    try:
        from_file = keys.read_file(file) if file else ()
        return keys.accepted(None, [*(keys.check(k, "--api-key") for k in given), *from_file])
    except ValueError as e:
        raise click.UsageError(str(e)) from None

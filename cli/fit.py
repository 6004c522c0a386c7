"""`justfit fit`: does it fit, and how much context does a budget hold."""

from __future__ import annotations

import json

import click
import psutil

from cli import common


@click.command()
@common.model_option
@common.budget_option
@click.option("--context", type=int, default=None, metavar="N",
              help="Also plan a request of N positions (prompt + reply).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@common.gguf_bits_option
@common.kv_format_option
@common.policy_option
def fit(model, budget, context, as_json, gguf_bits, kv_format, policy) -> None:
    """Weights, KV bytes per position, transient bound and maximum context per KV
    format for a memory budget (default: memory available now), without running."""
    from justfit.fit import fit_report, format_fit

    budget = budget or psutil.virtual_memory().available
    engine = common.load_engine(model, None, gguf_bits, kv_format, policy)
    report = fit_report(engine, budget, context)
    click.echo(json.dumps(report, indent=2) if as_json else format_fit(report))

"""`justfit fit`: does it fit, and how much context does a budget hold."""

from __future__ import annotations

import json

import click
import psutil

from justfit.memory import format_size

from . import common


@click.command()
@common.model_option
@common.budget_option
@click.option("--context", type=int, default=None, metavar="N",
              help="Also plan a request of N positions (prompt + reply).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--config", "config_path", default=None, metavar="CONFIG",
              help="Plan from a Hugging Face config.json (or its folder) alone, before downloading weights.")
@click.option("--weights-bits", type=click.Choice(["2", "3", "4", "5", "6", "8", "16"]), default="4",
              show_default=True, help="With --config: the weights' bit width (16: unquantized).")
@click.option("--compute", type=click.Choice(["fp16", "fp32"]), default="fp16", show_default=True,
              help="With --config: activation width (fp16 on Apple GPUs, fp32 on MLX's CPU backend).")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True,
              help="Plan a layer pipeline over this many ranks, each with --budget (or one size per rank).")
@click.option("--kv-disk", "kv_disk", default=None, is_flag=False, flag_value="auto", metavar="[FOLDER]",
              help="Also plan with every growing layer's KV pages on disk in FOLDER (default: kv-pages in the "
                   "state directory): positions, disk space, bytes read a token, predicted decode rate.")
@click.option("--disk-bandwidth", default=None, metavar="RATE",
              help="With --kv-disk: the folder's sequential read rate (e.g. 6GB/s, 500MB/s); default: measured "
                   "there with a short read past the page cache.")
@common.whole_process_option
@common.gguf_bits_option
@common.kv_format_option
@common.policy_option
def fit(model, budget, context, as_json, config_path, weights_bits, compute, ranks, whole_process, gguf_bits,
        kv_format, policy, kv_disk, disk_bandwidth) -> None:
    """Weights, KV bytes per position, transient bound and maximum context per KV
    format for a memory budget (default: memory available now), without running;
    with --config, from a model's config.json alone."""
    from justfit.planning.breakdown import format_breakdown, process_breakdown
    from justfit.planning.fit import fit_report, format_fit

    disk = _disk_setup(kv_disk, disk_bandwidth, kv_format, ranks)
    budgets = budget if isinstance(budget, tuple) else (budget or psutil.virtual_memory().available,) * ranks
    common.rank_budget(budgets, 0, ranks)  # one size per rank, if a list
    budget = budgets[0]
    if config_path is not None:
        from justfit.planning.fit_config import config_fit_report, format_config_fit, load_config
        from kvexec import KVConfig

        if model is not None:
            raise common.UserError("give --model or --config, not both")
        if whole_process:
            raise common.UserError("--whole-process measures a loaded model's process: give --model, not --config")
        # Calibration needs the weights: from a config alone, plan with its widest candidate.
        kv = None if kv_format == "none" else KVConfig(format="q8c" if kv_format == "calibrated" else kv_format)
        try:
            report = config_fit_report(load_config(config_path), int(weights_bits), budget, context, kv,
                                       4 if compute == "fp32" else 2)
        except ValueError as e:
            raise common.UserError(str(e)) from None
        text = format_config_fit(report)
        if disk is not None:
            from justfit.planning.disk_plan import format_disk
            from justfit.planning.fit_config import config_disk_report

            try:
                report["kv_disk_plan"] = config_disk_report(
                    load_config(config_path), int(weights_bits), budget, disk[0], disk[1], context,
                    None if kv_format == "calibrated" else KVConfig(format=kv_format), 4 if compute == "fp32" else 2)
            except ValueError as e:
                raise common.UserError(str(e)) from None
            text = "\n".join([text, "", *format_disk(report["kv_disk_plan"])])
        click.echo(json.dumps(report, indent=2) if as_json else text)
        return
    first = _first_load(model, gguf_bits, kv_format)  # before the load below does it
    engine = common.load_engine(model, None, gguf_bits, kv_format, policy,
                                **({"kv_disk": disk[0]} if disk is not None else {}))
    outside = 0
    if whole_process:  # what this process holds besides MLX, loaded: every rank holds as much
        from justfit.planning.budget import measure_outside

        outside = measure_outside()
        if min(budgets) <= outside:
            raise common.UserError(f"a whole-process budget of {format_size(min(budgets))} is no more than what "
                                   f"the process holds besides the engine ({format_size(outside)})")
        budgets = tuple(b - outside for b in budgets)
    if ranks > 1:
        from justfit.planning.fit_ranks import format_ranks, ranks_report

        try:
            report = {**ranks_report(engine, list(budgets)), "outside": outside}
        except ValueError as e:
            raise common.UserError(str(e)) from None
        click.echo(json.dumps(report, indent=2) if as_json else format_ranks(report))
        return
    report = fit_report(engine, budgets[0], context, outside)
    report["process"] = process_breakdown(engine)  # measured now, loaded, before any request
    lines = [format_fit(report), "", *format_breakdown(report["process"])]
    if disk is not None:
        from justfit.planning.disk_plan import engine_disk_report, format_disk

        try:
            report["kv_disk_plan"] = engine_disk_report(engine, budgets[0], disk[1], context)
        except ValueError as e:
            raise common.UserError(str(e)) from None
        lines += ["", *format_disk(report["kv_disk_plan"])]
    if first is not None:
        report["first_load"] = first.as_dict()
        lines += ["", f"{first.describe()}: done by this command, then cached; a whole-process budget below "
                  "it would have been refused before any work"]
    text = "\n".join(lines)
    click.echo(json.dumps(report, indent=2) if as_json else text)


def _disk_setup(kv_disk: str | None, bandwidth: str | None, kv_format: str, ranks: int):
    """(folder, Bandwidth) for --kv-disk (None without it): the folder checked writable,
    the bandwidth parsed, else measured there."""
    if kv_disk is None or kv_disk == "off":
        if bandwidth is not None:
            raise common.UserError("--disk-bandwidth goes with --kv-disk")
        return None
    from justfit.planning.disk_bandwidth import Bandwidth, measure_bandwidth, parse_bandwidth, writable_folder

    if kv_format == "none":
        raise common.UserError("--kv-disk plans KVExec pages on disk: not with --kv-format none")
    if ranks > 1:
        raise common.UserError("--kv-disk plans one process: not with --ranks")
    try:
        rate = None if bandwidth is None else parse_bandwidth(bandwidth)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--disk-bandwidth") from None
    try:
        folder = writable_folder(common.kv_disk_folder(kv_disk))
    except ValueError as e:
        raise common.UserError(str(e)) from None
    return folder, Bandwidth(rate, "given") if rate is not None else measure_bandwidth(folder)


def _first_load(model: str | None, gguf_bits: int | str, kv_format: str):
    """The first load's prediction (justfit.model.first_load) where the model is not yet
    converted or calibrated; None otherwise."""
    from justfit import Engine
    from justfit.config import EngineConfig
    from kvexec import KVConfig

    kv = None if kv_format == "none" else KVConfig(format=kv_format)
    first = Engine.first_load(model, EngineConfig(gguf_bits=gguf_bits, kv=kv))
    return first if first.pending else None

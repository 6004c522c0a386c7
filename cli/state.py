"""`justfit state`: what the state directory holds (named sessions and anonymous
prefix-cache states), and removing, verifying and trimming it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from cli import common

state_dir_option = click.option("--state-dir", default=None, metavar="DIR",
                                 help="The state directory (default: $JUSTFIT_STATE_DIR or JustFit's own).")


def _root(state_dir: str | None) -> Path:
    from justfit.state_io import state_root

    return state_root(state_dir)


def _parse_size(value: str) -> int:
    from justfit.memory import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


@click.group()
def state() -> None:
    """Stored conversation states: list, remove, verify, collect garbage."""


@state.command("ls")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def ls(state_dir, as_json) -> None:
    """Sessions and anonymous states: tokens, bytes, KV format, model, age."""
    from statetrans.admin import inventory

    root = _root(state_dir)
    items = inventory(root)
    if as_json:
        click.echo(json.dumps([{"session": s.session, "tokens": s.tokens, "bytes": s.bytes, "format": s.format,
                                "model": s.model, "age_s": round(s.age_s, 1), "generation": s.generation,
                                "current": s.current, "path": str(s.path), "error": s.error} for s in items],
                              indent=2))
        return
    if not items:
        click.echo(f"nothing stored in {root}")
        return
    click.echo(f"{'NAME':24} {'TOKENS':>8} {'SIZE':>10} {'FORMAT':8} {'AGE':>5}  MODEL")
    for s in items:
        name = (s.session if s.session is not None else "(anonymous)") + ("" if s.current else " (superseded)")
        if s.error:
            click.echo(f"{'(unreadable)':24} {s.path}: {s.error}")
            continue
        click.echo(f"{name[:24]:24} {s.tokens:>8} {_size(s.bytes):>10} {s.format:8} {_age(s.age_s):>5}  {s.model}")
    click.echo(f"{len(items)} snapshots, {_size(sum(s.bytes for s in items))} in {root}")


@state.command("rm")
@state_dir_option
@click.argument("name")
def rm(state_dir, name) -> None:
    """Delete the named session NAME."""
    from statetrans.admin import remove_session

    if not remove_session(_root(state_dir), name):
        raise common.UserError(f"no session {name!r} in {_root(state_dir)}")
    click.echo(f"removed session {name!r}")


@state.command("verify")
@state_dir_option
@click.option("--remove", is_flag=True, help="Delete the broken snapshots (a session's older generation takes over).")
def verify(state_dir, remove) -> None:
    """Check every snapshot's checksums; report (and with --remove delete) broken ones."""
    from statetrans.admin import inventory, verify as check

    root = _root(state_dir)
    total = len(inventory(root))
    broken = check(root, remove)
    for path, why in broken:
        click.echo(f"broken: {why}" + (" (removed)" if remove else ""))
    click.echo(f"{total - len(broken)} of {total} snapshots intact")
    if broken and not remove:
        raise SystemExit(1)


@state.command("gc")
@state_dir_option
@click.option("--keep", required=True, metavar="SIZE", callback=lambda ctx, param, value: _parse_size(value),
              help="Trim anonymous states (oldest first) until the directory holds at most SIZE, e.g. 2GiB.")
def gc(state_dir, keep) -> None:
    """Remove leftovers and superseded generations, then anonymous states down to
    --keep SIZE. Named sessions and running processes' states are never removed."""
    from statetrans.admin import gc as collect

    removed, freed = collect(_root(state_dir), keep)
    click.echo(f"removed {removed} snapshots, freed {_size(freed)}")

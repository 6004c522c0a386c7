"""`justfit state`: what the state directory holds (named sessions and anonymous
prefix-cache states), and removing, verifying and trimming it.

Names are printed as they are when they are plain printable text, else as a JSON
string (quoted, every odd character escaped: control characters, lone surrogates), and
`state rm` takes either form; everything else read from the directory (paths, reasons,
model names) is printed with its unprintable characters escaped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from . import common

state_dir_option = click.option("--state-dir", default=None, metavar="DIR",
                                 help="The state directory (default: $JUSTFIT_STATE_DIR or JustFit's own).")


def _root(state_dir: str | None) -> Path:
    from justfit.engine.state_io import state_root

    return state_root(state_dir)


def _parse_size(value: str) -> int:
    from justfit.memory import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


def _size(n: int) -> str:
    for unit, span in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= span:
            return f"{n / span:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def shown(name: str) -> str:
    """A stored name as `state ls` prints it (see the module doc); `state rm` takes it back."""
    if name and name.isprintable() and not name.startswith('"') and name == name.strip():
        return name
    return json.dumps(name)


def candidates(name: str) -> list[str]:
    """The stored names `name` (as typed) may mean: itself, and what it says as a JSON string."""
    out = [name]
    if name.startswith('"'):
        try:
            decoded = json.loads(name)
        except ValueError:
            decoded = None
        if isinstance(decoded, str) and decoded != name:
            out.append(decoded)
    return out


def _safe(text: str) -> str:
    """`text` with its unprintable characters escaped (never an encoding error, no
    terminal control sequences from a file's content)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


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
    from statetrans.admin import inventory, quarantine_items

    root = _root(state_dir)
    items = inventory(root)
    if as_json:
        click.echo(json.dumps([{"session": s.session, "scope": s.scope, "tokens": s.tokens, "bytes": s.bytes,
                                "format": s.format, "model": s.model, "age_s": round(s.age_s, 1),
                                "generation": s.generation, "current": s.current,
                                "path": str(s.path),
                                "error": s.error} for s in items], indent=2))
        return
    held = quarantine_items(root)
    if not items and not held:
        click.echo(f"nothing stored in {_safe(root)}")
        return
    click.echo(f"{'NAME':24} {'TOKENS':>8} {'SIZE':>10} {'FORMAT':8} {'AGE':>5}  MODEL")
    for s in items:
        name = (shown(s.session) if s.session is not None else "(anonymous)") + ("" if s.current else " (superseded)")
        if s.error:
            click.echo(f"{'(unreadable)':24} {_safe(s.path)}: {_safe(s.error)}")
            continue
        click.echo(f"{name:24} {s.tokens:>8} {_size(s.bytes):>10} {_safe(s.format):8} {_age(s.age_s):>5}  "
                   f"{_safe(s.model)}")
    click.echo(f"{len(items)} snapshots, {_size(sum(s.bytes for s in items))} in {_safe(root)}")
    if held:
        click.echo(f"{len(held)} quarantined (see justfit state verify)")


@state.command("rm")
@state_dir_option
@click.argument("name")
def rm(state_dir, name) -> None:
    """Delete the named session NAME (as `state ls` prints it, or as it is)."""
    from statetrans.admin import remove_session

    root = _root(state_dir)
    for candidate in candidates(name):
        try:
            found = remove_session(root, candidate)
        except OSError as e:
            raise common.UserError(f"cannot remove session '{shown(candidate)}': {_safe(e)}") from None
        if found:
            click.echo(f"removed session '{shown(candidate)}'")
            return
    raise common.UserError(f"no session '{shown(name)}' in {_safe(root)}")


@state.command("verify")
@state_dir_option
@click.option("--remove", is_flag=True, help="Delete what is quarantined, the broken snapshots just found included.")
@click.option("--state-disk", default=None, metavar="SIZE",
              callback=lambda ctx, param, value: _parse_size(value) if value else None,
              help="The state directory's size, as `justfit serve --state-disk` has it (default: the same as "
                   "serve's); the quarantine keeps 1/20 of it, oldest items deleted first.")
def verify(state_dir, remove, state_disk) -> None:
    """Check every snapshot (checksums, header, structure); move broken ones into
    quarantine (a session's older generation takes over) within its limit, list what
    the quarantine holds (count, bytes, limit), and with --remove delete it."""
    from statetrans.admin import purge_quarantine, quarantine_items, verify as check
    from statetrans.quota import default_state_disk, quarantine_limit, split_state_disk

    root = _root(state_dir)
    size = state_disk if state_disk is not None else default_state_disk(root)
    limit = quarantine_limit(size, split_state_disk(size)[1])
    total, broken = check(root, limit)
    for path, why, moved in broken:
        where = f"quarantined as {moved.name}" if moved is not None else "cannot be read now; left in place"
        if moved is not None and not os.path.lexists(moved):
            where += ", then deleted: over the quarantine's limit"
        click.echo(f"broken: {_safe(why)} ({_safe(where)})")
    fresh = {moved for _, _, moved in broken if moved is not None}
    held = quarantine_items(root)
    for q in held:
        if q.path not in fresh:
            click.echo(f"quarantined: {_safe(q.source)} ({_safe(q.path.name)}): {_safe(q.reason)}"
                       + (" (removed)" if remove else ""))
    if remove and held:
        try:
            purge_quarantine(root)
        except OSError as e:
            raise common.UserError(f"cannot empty the quarantine: {_safe(e)}") from None
        click.echo(f"removed {len(held)} quarantined item{'s' if len(held) != 1 else ''}")
    kept = [] if remove else held
    click.echo(f"quarantine: {len(kept)} item{'s' if len(kept) != 1 else ''}, {_size(sum(q.bytes for q in kept))} "
               f"(limit {_size(limit)} per model)")
    click.echo(f"{total - len(broken)} of {total} snapshots intact")
    if any(moved is None for _, _, moved in broken) or ((broken or held) and not remove):
        raise SystemExit(1)


@state.command("gc")
@state_dir_option
@click.option("--keep", required=True, metavar="SIZE", callback=lambda ctx, param, value: _parse_size(value),
              help="Trim anonymous states (oldest first) until the directory holds at most SIZE, e.g. 2GiB.")
def gc(state_dir, keep) -> None:
    """Remove leftovers and superseded generations, then anonymous states down to
    --keep SIZE. Named sessions and running processes' states are never removed."""
    from statetrans.admin import gc as collect

    try:
        removed, freed = collect(_root(state_dir), keep)
    except OSError as e:
        raise common.UserError(f"cannot collect garbage in {_safe(_root(state_dir))}: {_safe(e)}") from None
    click.echo(f"removed {removed} snapshots, freed {_size(freed)}")

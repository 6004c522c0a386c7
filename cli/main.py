"""`justfit`: the command group. Thin on purpose: parse, call justfit, print."""

from __future__ import annotations

import importlib
import os
import sys

import click

import justfit
from justfit import runtime
from justfit.errors import JustFitError

from .common import UserError, one_line, relaunch_as_ranks

# Subcommands, imported on first use: name -> "module:attribute", the module relative to
# this package (cli/ in the repository, justfit.cli once installed).
COMMANDS: dict[str, str] = {
    "chat": ".chat:chat",
    "generate": ".generate:generate",
    "bench": ".bench:bench",
    "fit": ".fit:fit",
    "serve": ".serve:serve",
    "state": ".state:state",
}

# What the engine raises for problems the user can act on: its own errors, a model
# that is not there (ModelNotFound is a FileNotFoundError), or one it cannot run
# (UnsupportedModel is a ValueError), and bad values.
USER_ERRORS = (JustFitError, FileNotFoundError, ValueError)


def debug() -> bool:
    return os.environ.get("JUSTFIT_DEBUG", "") not in ("", "0")


class JustFitGroup(click.Group):
    def main(self, args=None, **kwargs):
        # Before any subcommand's module loads mlx.core: OpenBLAS only binds if first.
        runtime.setup()
        # --ranks N: this process becomes the ranks' launcher before click parses (exec).
        relaunch_as_ranks(self, sys.argv[1:] if args is None else list(args))
        return super().main(args, **kwargs)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS and name not in self.commands:
            module, attr = COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module, __package__), attr), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            if debug():
                raise
            raise UserError(one_line(e)) from e


@click.group(cls=JustFitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(justfit.__version__, "--version", "-V", prog_name="justfit")
def main() -> None:
    """JustFit: a local long-context LLM engine on MLX.

    Set JUSTFIT_DEBUG=1 to see full tracebacks instead of one-line errors.
    """


if __name__ == "__main__":
    main(prog_name="justfit")

"""Pieces the subcommands share: user-facing errors, common options, engine loading."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import click

from justfit import runtime  # loads nothing else (justfit/runtime.py)
from justfit.pipeline.launch import launched, stop_grace, watch_launcher  # the standard library only


class UserError(click.ClickException):
    """A problem the user can fix: printed as one `error: ...` line, exit status 1."""

    exit_code = 1

    def show(self, file=None) -> None:  # noqa: D102 - click's signature
        click.echo(f"error: {self.format_message()}", file=file or sys.stderr)


def one_line(exc: BaseException) -> str:
    """The exception's message on a single line (its class name when it has none)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, KeyError) and text.startswith("'"):
        text = text.strip("'")
    return text or type(exc).__name__


def _parse_budget(ctx: click.Context, param: click.Parameter, value: str | None) -> int | tuple[int, ...] | None:
    """One size, or a comma-separated size per rank of a layer pipeline (a tuple)."""
    if value is None:
        return None
    from justfit.memory import parse_size  # here: importing the CLI must not load mlx.core (see cli/main.py)

    try:
        sizes = tuple(parse_size(part) for part in value.split(","))
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from e
    return sizes[0] if len(sizes) == 1 else sizes


def rank_budget(budget: int | tuple[int, ...] | None, rank: int, ranks: int) -> int | None:
    """This rank's budget: the one given, or its entry of a per-rank list (which must
    name every rank)."""
    if not isinstance(budget, tuple):
        return budget
    if len(budget) != ranks:
        raise UserError(f"--budget gives {len(budget)} sizes, one per rank, for {ranks} rank(s)")
    return budget[rank]


model_option = click.option(
    "--model", "-m", default=None, metavar="MODEL",
    help="smollm2 (default, embedded), gemma3, a .gguf file, an mlx-lm folder or a Hugging Face id.",
)
budget_option = click.option(
    "--budget", default=None, metavar="SIZE", callback=_parse_budget,
    help="Memory budget, e.g. 2GiB; requests that would not fit are refused. On a layer pipeline, "
         "one for every rank or one per rank (800MiB,1.5GiB).",
)
whole_process_option = click.option(
    "--whole-process", is_flag=True,
    help="The budget covers the whole process: what it holds besides the engine "
         "(interpreter, libraries, tokenizer), measured as it runs, is taken off.",
)


def _parse_bits(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    return value if value in ("exact", "native") else int(value)


gguf_bits_option = click.option(
    "--gguf-bits", type=click.Choice(["native", "exact", "2", "3", "4", "5", "6", "8"]),
    default="native", show_default=True, callback=_parse_bits,
    help="GGUF import precision: native keeps every affine block type exact (others at "
         "8 bits), exact keeps all of llama.cpp's values, a number re-quantizes to it.",
)


class LazyChoice(click.Choice):
    """A click.Choice whose choices are read when first needed (parsing, help): reading
    them imports kvexec or phaseswap, hence mlx.core, which must wait until the
    command's runtime.setup() has preloaded OpenBLAS (see cli/main.py)."""

    def __init__(self, load: Callable[[], list[str]]):
        self._load, self._choices = load, None
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        if self._choices is None:
            self._choices = tuple(self._load())
        return self._choices

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ sets it; the loader decides
        pass


def _kv_formats() -> list[str]:
    from kvexec import FORMATS

    return ["calibrated", *FORMATS, "none"]


kv_format_option = click.option(
    "--kv-format", type=LazyChoice(_kv_formats), default="calibrated", show_default=True,
    help="KV page format (see docs/KVEXEC.md); calibrated: per layer, the smallest format that keeps the "
         "model's output within a KL budget (measured once per model, cached); none uses mlx-lm's own KV cache.",
)


def _policies() -> list[str]:
    from phaseswap import POLICIES

    return ["auto", *POLICIES]


policy_option = click.option(
    "--policy", type=LazyChoice(_policies), default="auto", show_default=True,
    help="PhaseSwap policy: cpu (8-bit decode weights, dense prefill just in time), "
         "cpu-exact, dense, quantized (Metal), measured; auto picks by backend.",
)

draft_option = click.option(
    "--draft", type=click.Choice(["ngram", "none"]), default="ngram", show_default=True,
    help="Speculative decoding: ngram drafts tokens from the text's own earlier matches and verifies "
         "them in one forward (same reply, fewer steps); none decodes one token per step.",
)


def deprecated_alias(flag: str, option: str, new: str, **kwargs) -> Callable:
    """An option's old spelling `flag`, hidden from --help: it still sets `option`'s
    value (so scripts keep working) and says, once, to write `new` instead."""
    name = f"old_spelling_of_{option}"

    def decorator(f: Callable) -> Callable:
        @functools.wraps(f)  # shares f's click params, so this option joins them
        def command(*args, **values):
            value = values.pop(name)
            if value is not None:
                click.echo(f"warning: {flag} is deprecated; use {new}", file=sys.stderr)
                values[option] = value
            return f(*args, **values)

        return click.option(flag, name, default=None, hidden=True, **kwargs)(command)

    return decorator


class RanksOption(click.Option):
    """The --ranks of a command that runs as a layer pipeline (not `fit`'s, which only
    plans one): read by `relaunch_as_ranks` before click parses anything."""


def relaunch_as_ranks(group: click.Group, args: list[str]) -> None:
    """`args` (the command line less the program) naming a command with --ranks N > 1,
    in a process that is not yet a rank: become the launcher (justfit.pipeline.launch)
    of this same command line as N local ranks of a layer pipeline. Called by the entry
    point (cli/main.py) before click parses: the ranks parse and check the options, once
    each. This process turns into the launcher (exec) rather than waiting on it, so a
    stop signal, or a service manager watching this process, reaches the launcher, and
    nothing is left behind when it is killed. Anything else returns: click parses (and
    refuses a bad --ranks) as usual."""
    if "MLX_RANK" in os.environ or any(a in ("-h", "--help") for a in args):
        return
    name = next((a for a in args if not a.startswith("-")), None)
    command = group.get_command(click.Context(group), name) if name else None
    if command is None or not any(isinstance(p, RanksOption) for p in command.params):
        return
    ranks = _option_value(command, args, "ranks")
    if ranks is None or ranks != int(ranks) or ranks <= 1:  # one rank, or a value click will refuse
        return
    rank_line = _without_ranks(sys.orig_argv[1:])  # the interpreter's options, the script or -m, the command
    drain = _option_value(command, args, "drain")  # a server's: how long the launcher waits before killing
    argv = launched(int(ranks), [sys.executable, *rank_line], None if drain is None else stop_grace(drain))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def _without_ranks(args: list[str]) -> list[str]:
    """`args` less --ranks and its value."""
    out, skip = [], False
    for a in args:
        if skip or a.startswith("--ranks="):
            skip = False
            continue
        if a == "--ranks":
            skip = True
            continue
        out.append(a)
    return out


def _option_value(command: click.Command, args: list[str], name: str) -> float | None:
    """The number `args` give `command`'s option `name` (else its default): what the
    launcher needs to know before the command has parsed it (a server's --drain, for how
    long to wait before killing the ranks); None when there is none to read."""
    option = next((p for p in command.params if p.name == name and isinstance(p, click.Option)), None)
    if option is None:
        return None
    value = option.default
    for i, a in enumerate(args):
        if a in option.opts and i + 1 < len(args):
            value = args[i + 1]
        elif any(a.startswith(f"{o}=") for o in option.opts):
            value = a.split("=", 1)[1]
    try:
        return float(value)
    except (TypeError, ValueError):  # the command itself will say what is wrong
        return None


ranks_option = click.option(
    "--ranks", cls=RanksOption, type=click.IntRange(min=1), default=1, show_default=True, expose_value=False,
    help="Run as a layer pipeline over N local ranks (ring backend on loopback); for several "
         "machines start the command with mlx.launch --hostfile instead.",
)


def options(*decorators: Callable) -> Callable:
    """Several click options as one decorator, in the order given."""
    def apply(f: Callable) -> Callable:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


# What chat and generate share: how to sample, and how the engine runs.
sampling_options = options(
    click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
                 help="Most tokens to generate (per reply)."),
    click.option("--temperature", "-t", type=click.FloatRange(min=0), default=None,
                 help="Sampling temperature; 0 is greedy. Default: the model's recommendation "
                      "(its generation_config.json or model card; else 0.6)."),
    click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
                 help="Nucleus sampling: keep the smallest token set with this much probability. "
                      "Default: the model's recommendation (else 0.9)."),
    click.option("--seed", type=int, default=None, help="Random seed, for repeatable sampling."),
)


def _parse_size_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from justfit.memory import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from e


kv_disk_options = options(
    click.option("--kv-disk", default="auto", metavar="DIR|off", show_default=True,
                 help="Folder for KV pages the budget cannot keep in memory: the planner puts some "
                      "layers' pages there and reads them back just in time (auto: kv-pages in the "
                      "state directory; off: never, pages step down to smaller formats instead)."),
    click.option("--kv-disk-limit", default=None, metavar="SIZE", callback=_parse_size_option,
                 help="Most bytes of KV pages on disk per request (default: half the folder's free space)."),
    click.option("--deterministic", is_flag=True,
                 help="One numerics per token: a reply does not depend on how the server computed it (a "
                      "cached prefix, the prefill chunk, a batch, a draft): prefill on the decode forms "
                      "through row-invariant kernels (slower prefill), or, where none run (MLX's own "
                      "kernels), one row per forward (far slower). `justfit fit` says which."),
)
engine_options = options(budget_option, whole_process_option, gguf_bits_option, kv_format_option, policy_option,
                         draft_option, kv_disk_options, ranks_option)


def kv_disk_folder(value: str | None) -> str | None:
    """--kv-disk's folder: None for off, the state directory's kv-pages for auto."""
    if value is None or value == "off":
        return None
    if value == "auto":
        from justfit.engine.state_io import state_root

        return str(state_root() / "kv-pages")
    return value


def load_engine(model: str | None, budget: int | tuple[int, ...] | None, gguf_bits: int | str = "native",
                kv_format: str = "calibrated", policy: str = "auto", whole_process: bool = False,
                state_disk: int | None = None, session_keep_s: float = 600.0, kv_disk: str | None = "auto",
                kv_disk_limit: int | None = None, deterministic: bool = False, draft: str = "ngram"):
    """Load the engine for a command (tests replace this to share one engine). On a
    rank > 0 of a layer pipeline this process computes its layers for rank 0 until rank 0
    stops, then returns None: the command has nothing more to do."""
    from justfit import Engine
    from justfit.config import EngineConfig
    from kvexec import KVConfig

    kv = None if kv_format == "none" else KVConfig(format=kv_format)
    group = launch_group()
    budget = rank_budget(budget, group.rank() if group else 0, group.size() if group else 1)
    engine = Engine(model=model, budget=budget, group=group,
                    config=EngineConfig(gguf_bits=gguf_bits, kv=kv, policy=policy, budget_covers_process=whole_process,
                                        state_disk=state_disk, session_keep_s=session_keep_s,
                                        kv_disk=kv_disk_folder(kv_disk) if kv is not None else None,
                                        kv_disk_limit=kv_disk_limit, deterministic=deterministic, draft=draft))
    runner = engine.runner
    if runner.rank > 0:
        click.echo(f"rank {runner.rank}: {runner.role}", file=sys.stderr)
        try:
            runner.follow(engine)
        except ConnectionError as e:  # rank 0, or the rank before this one, is gone
            raise UserError(f"rank {runner.rank}: {e}; leaving") from None
        return None
    runtime.at_exit(runner.close)  # as this process leaves, whatever follows it goes too (a pipeline's ranks)
    return engine


def pipeline_follower() -> bool:
    """Whether this process is a rank > 0 of a layer pipeline: its input is what rank 0
    sends through the pipeline, never stdin (which rank 0 alone reads)."""
    return int(os.environ.get("MLX_RANK", "0")) > 0


def launch_group():
    """The mx.distributed group when started by `mlx.launch` with two or more ranks
    (a layer pipeline: justfit.pipeline.layers), else None."""
    if "MLX_RANK" not in os.environ:
        return None
    watch_launcher()  # under justfit.pipeline.launch: leave when it is gone
    import mlx.core as mx

    group = mx.distributed.init()
    return group if group.size() > 1 else None

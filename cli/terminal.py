"""Terminal plumbing for `justfit chat`: Ctrl-C handling, the prefill progress bar,
the loader's notes, and where input lines come from."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TextIO



@contextmanager
def loader_notes(stream: TextIO) -> Iterator[None]:
    """While a model loads, show what the loader says it is doing (a first load's KV
    calibration takes a while) as dim lines on `stream`; the logger is as before after."""
    import click

    logger = logging.getLogger("justfit.loader")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(click.style("%(message)s...", dim=True)))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Stopped(Exception):
    """Raised from the progress callback to stop a prefill at a chunk boundary."""


@contextmanager
def deferred_sigint(on_interrupt: Callable[[], None], at_once: bool = True) -> Iterator[None]:
    """While generating, a first Ctrl-C only asks to stop (so the engine stops between
    tokens and its kept state stays exact); a second one interrupts at once, unless not
    `at_once` (a layer pipeline's ranks finish each step together): it asks again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    presses = 0

    def handler(signum, frame):
        nonlocal presses
        presses += 1
        if presses > 1 and at_once:
            raise KeyboardInterrupt
        on_interrupt()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class PrefillBar:
    """A one-line progress bar on `stream` while a long prompt is prefilled.

    Called as the engine's progress callback (done, total). The engine reports the
    cached prefix as already done on its first call, so only new tokens count
    against `min_tokens`.
    """

    def __init__(self, stream: TextIO, enabled: bool = True, min_tokens: int = 256, width: int = 30):
        self.stream, self.enabled, self.min_tokens, self.width = stream, enabled, min_tokens, width
        self.start: int | None = None
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if self.start is None:
            self.start = done
        if not self.enabled or total - self.start <= self.min_tokens:
            return
        new, total_new = done - self.start, total - self.start
        filled = self.width * new // max(1, total_new)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\rprefill [{bar}] {new}/{total_new} tokens")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def line_reader(lines: Iterable[str] | Callable[[str], str]) -> Callable[[str], str]:
    """A `read(prompt) -> line` function that raises EOFError at the end."""
    if callable(lines):
        return lines
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it).rstrip("\r\n")
        except StopIteration:
            raise EOFError from None

    return read


def tty_reader() -> Callable[[str], str]:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    return input

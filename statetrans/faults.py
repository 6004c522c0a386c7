"""Crash points for the kill-injection tests: a test process that calls
`install(Faults.parse("POINT:N"))` SIGKILLs itself the N-th time a StateTiers made
afterwards reaches POINT (write, fsync, publish, published, cleanup, spill). Only the
test harness installs one (tests/helpers/state_crash_child.py): production code reads no
fault switch, and without one reaching a point does nothing."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, replace


@dataclass
class Faults:
    """A crash point, and the countdown of visits to it at whose end the process dies."""

    point: str | None = None
    countdown: int = 0

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        """The crash point "POINT:N" names (N defaults to 1; "" names none)."""
        point, _, n = spec.partition(":")
        return cls(point or None, int(n or 1))

    def reach(self, name: str) -> None:
        """Die here, without cleanup, when this is the requested point's N-th visit."""
        if name != self.point:
            return
        self.countdown -= 1
        if self.countdown <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


NONE = Faults()

_installed = NONE  # the test harness's crash point for this process, if any


def install(faults: Faults) -> None:
    """Make StateTiers made from now on in this process die at `faults`' point (tests only)."""
    global _installed
    _installed = faults


def installed() -> Faults:
    """A fresh countdown of the installed crash point (each StateTiers counts its own visits)."""
    return replace(_installed)

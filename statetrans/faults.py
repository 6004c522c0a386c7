"""Crash points for the kill-injection tests: with JUSTFIT_STATE_FAULT="POINT:N" set,
the process SIGKILLs itself the N-th time it reaches POINT (write, fsync, publish,
published, cleanup, spill). Unset, reaching a point does nothing."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "JUSTFIT_STATE_FAULT"


@dataclass
class Faults:
    """A crash point, and the countdown of visits to it at whose end the process dies."""

    point: str | None = None
    countdown: int = 0

    @classmethod
    def from_env(cls) -> "Faults":
        """The crash point the environment asks for, if any."""
        point, _, n = os.environ.get(ENV, "").partition(":")
        return cls(point or None, int(n or 1))

    def reach(self, name: str) -> None:
        """Die here, without cleanup, when this is the requested point's N-th visit."""
        if name != self.point:
            return
        self.countdown -= 1
        if self.countdown <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


NONE = Faults()

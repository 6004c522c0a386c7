"""An engine failure as the client's answer: its stable code (justfit.errors,
justfit.engine.events.Failure) decides the HTTP status and error type; each API
family shapes the answer its own way (justfit.server.*_format)."""

from __future__ import annotations

from justfit.engine.events import Failure
from justfit.errors import INTERNAL_ERROR
from justfit.server.schema import BadRequest

# code -> (HTTP status, OpenAI's error type); a code not named is a request that does not fit.
STATUSES = {"pipeline_degraded": (503, "server_error"), "server_stopping": (503, "server_error"),
            "server_busy": (503, "server_busy")}


def failure_answer(failure: Failure) -> BadRequest:
    """The answer to `failure`: a JustFitError's own readable message under its code;
    anything else a 500 whose details stay in the log (never the exception's text)."""
    if failure.code == INTERNAL_ERROR:
        return BadRequest("internal error while generating", None, 500, "server_error")
    status, kind = STATUSES.get(failure.code, (400, failure.code))
    return BadRequest(str(failure.error), None, status, kind, failure.code)

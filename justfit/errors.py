"""Errors the user can act on; their message is one readable line. Each class names the
stable code the server answers with when it ends a request (justfit.server.failures
maps codes to HTTP)."""

# The code of a failure that is no JustFitError: a bug, whose details stay in the log.
INTERNAL_ERROR = "internal_error"


class JustFitError(Exception):
    """An error the user can act on; its message says how."""

    code = "context_length_exceeded"  # most say the request does not fit; subclasses say otherwise


def error_code(error: BaseException) -> str:
    """The stable code of an engine failure: its class's, else INTERNAL_ERROR."""
    return error.code if isinstance(error, JustFitError) else INTERNAL_ERROR


class ContextTooLong(JustFitError):
    """The prompt plus the tokens to generate exceed the positions allowed."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int,
                 what: str = "positions this model supports"):
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        super().__init__(
            f"prompt too long: {prompt_tokens} prompt tokens + {max_tokens} to generate "
            f"> {limit} {what}; shorten the prompt or lower max_tokens "
            f"to {max(0, limit - prompt_tokens)}"
        )


class BudgetExceeded(JustFitError):
    """A request needs more memory than the budget allows."""

    def __init__(self, needed: int, budget: int, fits_positions: int, positions: int):
        from justfit.memory import format_size

        self.needed, self.budget = needed, budget
        self.fits_positions, self.positions = fits_positions, positions
        super().__init__(
            f"does not fit the memory budget: {positions} positions need about "
            f"{format_size(needed)} > budget {format_size(budget)}; at most {fits_positions} "
            f"positions fit; raise --budget or shorten the prompt"
        )


class FirstLoadExceeded(JustFitError):
    """A model's first load (converting its GGUF file, measuring its KV calibration) would
    peak above the whole-process budget: refused before any work."""

    def __init__(self, described: str, peak: int, budget: int, calibrates: bool):
        from justfit.memory import format_size

        self.peak, self.budget = peak, budget
        ways = ["load it once without --budget (it is converted and calibrated once, then cached)"]
        if calibrates:
            ways.insert(0, "a fixed page format (--kv-format q8c) skips the calibration")
        super().__init__(f"does not fit the memory budget: {described} > budget {format_size(budget)}; "
                         f"raise --budget, or {', or '.join(ways)}")


class KVDiskFull(BudgetExceeded):
    """The KV pages a request would keep on disk exceed the room the KV folder allows."""

    def __init__(self, needed: int, room: int, positions: int, folder: str):
        from justfit.memory import format_size

        self.needed, self.budget, self.fits_positions, self.positions = needed, room, 0, positions
        JustFitError.__init__(
            self, f"does not fit the KV disk: {positions} positions need {format_size(needed)} of pages on disk "
            f"> {format_size(room)} allowed in {folder}; free space there, raise --kv-disk-limit "
            f"or shorten the prompt")


class PipelineLost(JustFitError):
    """A rank of the layer pipeline stopped answering: nothing can run until it is back."""

    code = "pipeline_degraded"

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"a rank of the layer pipeline is gone ({reason}); restart all ranks")


class ServerStopping(JustFitError):
    """The server is stopping (a service manager's SIGTERM, Ctrl-C): retry elsewhere or later."""

    code = "server_stopping"

    def __init__(self):
        super().__init__("the server is stopping; retry once it is back")


class GrammarError(JustFitError, ValueError):
    """A constraint on the output (a JSON schema, regex or grammar: justfit.config.OutputConstraint)
    that the engine cannot compile, uses keywords it does not enforce, or exceeds its
    limits; refused before any work, the message naming what failed."""

    code = "invalid_grammar"

    def __init__(self, kind: str, reason: str):
        reason = " ".join(reason.split())  # one line (llguidance's errors draw a caret under the grammar)
        self.kind, self.reason = kind, reason if len(reason) <= 600 else reason[:597] + "..."
        super().__init__(f"invalid {kind.replace('_', ' ')} constraint: {self.reason}")

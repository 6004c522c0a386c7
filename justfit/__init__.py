"""JustFit: a local long-context LLM engine on MLX.

Importing this package changes nothing in the process: what JustFit needs from it
(OpenBLAS, the shared MLX stream) happens in `justfit.runtime.setup()`, which the
command line, the server and `Engine` call. The engine's names are imported on first
use, so `from justfit import runtime` loads nothing else (in particular not
`mlx.core`, which must come after OpenBLAS).
"""

from __future__ import annotations

import importlib

__all__ = ["Engine", "GenerationStats", "Reply", "SamplingParams"]
__version__ = "0.1.0"

# Public name -> the module that defines it, imported when first asked for.
_LAZY = {"Engine": "justfit.engine.facade", "GenerationStats": "justfit.engine.stats", "Reply": "justfit.engine.stats",
         "SamplingParams": "justfit.config"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'justfit' has no attribute {name!r}")

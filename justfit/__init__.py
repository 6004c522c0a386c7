"""JustFit: a local long-context LLM engine on MLX.

OpenBLAS is preloaded here, before anything imports `mlx.core`, so MLX's CPU
backend binds to it (see justfit/blas.py).
"""

from justfit import blas as _blas

_blas.preload()

from justfit.streams import use_shared_stream  # noqa: E402

use_shared_stream()  # lets the server's engine thread evaluate arrays made here

from justfit.engine import Engine, GenerationStats, SamplingParams  # noqa: E402

__all__ = ["Engine", "GenerationStats", "SamplingParams"]
__version__ = "0.1.0"

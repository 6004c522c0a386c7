"""The `justfit` command line.

`import justfit` comes first, before anything imports `mlx.core`, so OpenBLAS is
preloaded and MLX's CPU backend binds to it (see justfit/blas.py).
"""

import justfit  # noqa: F401  (must stay the first import)

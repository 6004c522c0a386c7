"""JustFit's native CPU kernels for MLX (built from native/*.cpp; loaded by phaseswap.native)."""

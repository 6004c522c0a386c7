"""JustFit's native CPU kernels for MLX (built from native/*.cpp): `kernels()` gives the
extension module, used by phaseswap.native (weights, RoPE, RMS norm) and kvexec.formats
(attention over quantized pages)."""

import functools


@functools.cache
def kernels():
    """The built extension module, or None when it cannot take MLX's arrays here."""
    try:
        import mlx.core as mx

        from justfit_native import _ext

        # A module built against another nanobind ABI than MLX's cannot take its arrays.
        w, scales, biases = mx.quantize(mx.ones((32, 32)), 32, 8)
        mx.eval(_ext.quantized_matvec(mx.ones((1, 32)), w, scales, biases, 32, 8))
    except (ImportError, TypeError, RuntimeError):
        return None
    return _ext

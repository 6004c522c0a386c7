"""JustFit's native CPU kernels for MLX (built from native/*.cpp): `kernels()` gives the
extension module, used by phaseswap.native (weights, RoPE, RMS norm) and kvexec.kernels
(attention over quantized pages); `dequantize` is the native dequantization both use.
`JUSTFIT_NATIVE=0` turns them off (read here only; justfit.runtime says so once)."""

import functools
import os

SWITCH = "JUSTFIT_NATIVE"  # "0": run without these kernels (MLX's own only, as on a Mac)


def requested() -> bool:
    """Whether the kernels may be used: JUSTFIT_NATIVE unset or not "0"."""
    return os.environ.get(SWITCH, "").strip() != "0"


@functools.cache
def kernels():
    """The built extension module, or None when turned off (JUSTFIT_NATIVE=0) or when it
    cannot take MLX's arrays here (looked up once)."""
    if not requested():
        return None
    try:
        import mlx.core as mx

        from justfit_native import _ext

        # A module built against another nanobind ABI than MLX's cannot take its arrays.
        w, scales, biases = mx.quantize(mx.ones((32, 32)), 32, 8)
        mx.eval(_ext.quantized_matvec(mx.ones((1, 32)), w, scales, biases, 32, 8))
    except (ImportError, TypeError, RuntimeError):
        return None
    return _ext


def dequantize(w, scales, biases, group_size: int, bits: int):
    """mx.dequantize in float32 by the native kernel on the CPU (MLX's unpacks 5- and 6-bit
    values bit by bit), or None where it does not apply: not built, off the CPU, a width or
    group it does not read, scales and biases not both float16 or both float32."""
    import mlx.core as mx

    ext = kernels()
    if (ext is None or mx.default_device() != mx.cpu or bits not in getattr(ext, "DEQUANTIZE_BITS", ())
            or group_size % 32 or scales.dtype not in (mx.float16, mx.float32) or biases.dtype != scales.dtype):
        return None
    return ext.dequantize(w, scales, biases, group_size, bits)

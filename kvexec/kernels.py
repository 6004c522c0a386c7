"""JustFit's native kernels as KVExec uses them on the CPU: where the extension is built
(`native/`), the page product, decode attention and the pages' dequantization run
there; elsewhere (not built, JUSTFIT_NATIVE=0, Metal) each caller keeps its MLX path."""

from __future__ import annotations

import functools

import mlx.core as mx

ROWS_KERNEL_MAX = 32  # query rows (decode, short chunks) the native page product takes


@functools.cache
def _page_kernels():
    """The built extension module when it has the page product, else None: not built,
    or off (JUSTFIT_NATIVE=0; justfit.runtime.native_kernels says which once)."""
    try:
        from justfit_native import kernels
    except ImportError:
        return None
    ext = kernels()
    return ext if ext is not None and hasattr(ext, "quantized_matmul_rows") else None


def rows_kernel():
    """JustFit's native kernels where built and computing on the CPU, else None."""
    ext = _page_kernels()
    return ext if ext is not None and mx.default_device() == mx.cpu else None


def dequantized(enc: dict[str, mx.array], group_size: int, bits: int) -> mx.array:
    """Stored groups back as float32: JustFit's native dequantize on the CPU where it reads
    the width (MLX's unpacks 5- and 6-bit groups bit by bit: a prefill block's keys and
    values took several times its attention), else MLX's."""
    native = None
    if rows_kernel() is not None:
        from justfit_native import dequantize

        native = dequantize(enc["w"], enc["scales"], enc["biases"], group_size, bits)
    if native is not None:
        return native
    return mx.dequantize(enc["w"], enc["scales"].astype(mx.float32), enc["biases"].astype(mx.float32),
                         group_size=group_size, bits=bits)


def channels_dequantized(parts: list, group_size: int, head_dim: int) -> mx.array | None:
    """Keys stored per channel, given as `native_parts` gives them ([(w, scales, biases,
    bits, columns)]), back as float32 [B, kv_heads, tokens, head_dim] in one native
    operation on the CPU; None where it does not apply (the caller decodes in MLX)."""
    ext = rows_kernel()
    widths = getattr(ext, "DEQUANTIZE_BITS", ())
    if ext is None or not hasattr(ext, "dequantize_channels") or group_size % 32 \
            or any(bits not in widths for *_, bits, _ in parts):
        return None
    columns = [idx for *_, idx in parts] if parts[0][-1] is not None else []
    return ext.dequantize_channels([w for w, *_ in parts], [s for _, s, *_ in parts], [b for _, _, b, *_ in parts],
                                   columns, group_size, [bits for *_, bits, _ in parts], head_dim)

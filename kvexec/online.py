"""The online softmax's pieces, as the blockwise executor (kvexec/attention.py) uses
them: a block's unnormalized probabilities against the running max, folding them into
the running sum and accumulator, and a plain softmax for the two-pass decode.

Numpy writes into MLX-owned memory in one place only, `softmax_step_numpy`, and only
into the score buffer the executor has just made for that step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvexec.kernels import rows_kernel


def softmax_step(s: mx.array, m: mx.array):
    """Unnormalized block probabilities against the running max. (mx.compile with
    shapeless=True crashed MLX 0.32's CPU backend here; per-shape compiles would
    recompile on every decode step, as the hot window grows.)"""
    m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
    m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with nothing visible yet
    return mx.exp(s - m_safe), mx.exp(m - m_safe), m_new, m_safe


def softmax_step_numpy(s: mx.array, m: mx.array):
    """`softmax_step` for large score blocks on the CPU backend: MLX's CPU `exp` is
    scalar, numpy's vectorized one far faster, and at long prefill the exponentials are
    most of attention's time.

    The one place JustFit writes into MLX-owned memory: the probabilities overwrite
    `s` in place, through numpy (a copy into a new MLX array would cost more than the
    exponentials, and an MLX subtraction into a new one slows prefill attention).
    `s` must be a buffer the executor just made and handed over, read by nothing
    else, before or after; anything else (a view, a read-only buffer) takes the MLX path."""
    mx.eval(s, m)
    s_np, m_np = np.asarray(s), np.asarray(m)
    if not (s_np.flags.c_contiguous and s_np.flags.writeable):
        return softmax_step(s, m)
    m_new = np.maximum(m_np, s_np.max(axis=-1, keepdims=True))
    m_safe = np.where(m_new == -np.inf, np.float32(0), m_new)
    np.subtract(s_np, m_safe, out=s_np)
    np.exp(s_np, out=s_np)
    corr = np.exp(m_np - m_safe)
    return s, mx.array(corr), mx.array(m_new), mx.array(m_safe)


def softmax(s: mx.array) -> mx.array:
    """Softmax over the last axis in float32: the native kernel on the CPU (MLX's CPU
    softmax takes its exponentials one at a time: at 8K decode most of attention)."""
    ext = rows_kernel()
    if ext is not None and hasattr(ext, "softmax") and s.dtype == mx.float32:
        return ext.softmax(s)
    return mx.softmax(s, axis=-1, precise=True)


def fold_block(l: mx.array, acc: mx.array, corr: mx.array, p: mx.array, pv: mx.array):
    """The running sum and accumulator rescaled to the new max (`corr`) with this block's
    probabilities `p` and weighted values `pv` added."""
    return l * corr + p.sum(axis=-1, keepdims=True), acc * corr + pv

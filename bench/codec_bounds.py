"""The Gaussian rate-distortion bound on either side of a page, for the codec study
(bench/codecs.py): what an ideal coder reaches on data read as Gaussian with the
variances the page codecs' own metadata hold, simulated by the bound's test channel.
No fixed-rate coder that models the data as Gaussian does better; one that models its
actual, non-Gaussian distribution could."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GROUP = 128  # tokens per per-channel key group, as the default's keys
SEED = 0x51C


def _test_channel(x: np.ndarray, var: np.ndarray, distortion: np.ndarray, rng) -> np.ndarray:
    """x through the Gaussian rate-distortion test channel around 0: a * x + noise of
    variance a * D (a = 1 - D / var), the reconstruction an ideal coder of Gaussian data
    reaches at distortion D."""
    a = 1 - distortion / np.maximum(var, 1e-30)
    return a * x + np.sqrt(a * distortion) * rng.standard_normal(x.shape)


def key_bound(q: np.ndarray, k: mx.array, rate: int, seed: int = SEED) -> tuple[mx.array, float]:
    """The Gaussian rate-distortion bound for keys stored as the allocated codec stores
    them: per channel and group of GROUP tokens a mean and a variance (the codec's two
    fp16 numbers), `rate` bits per value on average per KV head, spent by reverse
    water-filling on the query-weighted squared error (E[q_c^2] D)."""
    kvh, n, d = k.shape[1:]
    x = np.array(k[0], dtype=np.float64)
    out, rng = np.empty_like(x), np.random.default_rng(seed)
    q2 = np.maximum((q.astype(np.float64) ** 2).reshape(kvh, -1, d).mean(axis=1), 1e-300)
    for h in range(kvh):
        for g in range(0, n, GROUP):
            part = x[h, g : g + GROUP]
            mean, var = part.mean(axis=0), np.maximum(part.var(axis=0), 1e-30)
            lo, hi = -60.0, 60.0  # log2 of the water level: bisection to spend `rate` a channel
            for _ in range(100):
                level = (lo + hi) / 2
                spent = np.maximum(0.0, 0.5 * np.log2(var * q2[h] / 2.0**level)).mean()
                lo, hi = (level, hi) if spent > rate else (lo, level)
            dist = np.minimum(var, 2.0**hi / q2[h])
            out[h, g : g + GROUP] = mean + _test_channel(part - mean, var, dist, rng)
    return mx.array(out[None].astype(np.float32)), rate + 32 / GROUP


def value_bound(v: mx.array, rate: int, seed: int = SEED) -> tuple[mx.array, float]:
    """The Gaussian rate-distortion bound for values stored as the rotated codecs store
    them: each token's vector, rotated, read as Gaussian coordinates of variance |v|^2 / d
    (the norm one fp16 number), `rate` bits each. The channel is isotropic, so it is
    applied without the rotation."""
    x = np.array(v, dtype=np.float64)
    var = (x**2).mean(axis=-1, keepdims=True)
    out = _test_channel(x, var, var * 2.0 ** (-2 * rate), np.random.default_rng(seed))
    return mx.array(out.astype(np.float32)), rate + 16 / v.shape[-1]

"""Key and value codecs measured where calibration measures them.

Each attention layer's queries, keys and values are recorded on calibration's fixed text
(kvexec/layer_error.py); one side is stored in a codec and the other kept exact, and the
layer's causal attention output is compared with the exact one (relative RMS error, every
position quantized). Summed over the layers, the squared errors are what calibration's
gain turns into output KL (kvexec/calibrate.py), so a codec that reaches the same sum at
fewer bits per value (every scale, bias and norm counted) would make smaller pages at
equal fidelity. Families:

- keys: calibration's allocated per-channel widths (`a`, the default's keys), the same on
  keys stored before RoPE (`pre`: RoPE undone before quantizing, applied again after
  decoding, widths allocated on the pre-RoPE ranges), allocated widths with the highest-
  weight channels of each head kept in fp16 (`o<n>`), widths allocated over all KV heads
  at once so that heads may differ (`j`), per-channel groups (`c`), rotated
  per-channel groups (`cr`), the rotated Lloyd-Max codebook with a norm per token (`r`,
  TurboQuant's MSE quantizer), and that codebook at one bit less plus TurboQuant's 1-bit
  QJL residual (`qjl`: signs of a Gaussian sketch of the residual and its norm, an
  unbiased estimate of q . k);
- values: rotated per-token groups of 64 (the default's values), unrotated per-token
  groups of 32, and the rotated codebook with a norm per token;
- on either side, the Gaussian rate-distortion bound (`bound`, `vbound-`,
  bench/codec_bounds.py): how far any coder of Gaussian-modelled data could go.

    python -m bench.codecs --model smollm2
"""

from __future__ import annotations

import argparse
import math
import time

from justfit import runtime

if __name__ == "__main__":
    runtime.setup()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.codec_bounds import GROUP, key_bound, value_bound  # noqa: E402
from kvexec.allocated import AllocatedCodec, allocate_widths, channel_weights  # noqa: E402
from kvexec.affine import Codec  # noqa: E402
from kvexec.rotated import RotatedCodec  # noqa: E402

SKETCH_SEED = 0x51C


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, window: int | None) -> mx.array:
    """Causal (and sliding-window) attention, [1, heads, T, D], float32."""
    T = q.shape[-2]
    pos = mx.arange(T)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible = visible & (pos[:, None] - pos[None, :] < window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=visible)


def rope(x: mx.array, module, inverse: bool = False) -> mx.array:
    """The layer's rotary embedding on positions 0..T-1 (inverse: undone)."""
    scale = -module.scale if inverse else module.scale
    return mx.fast.rope(x, module.dims, traditional=module.traditional, base=module.base, scale=scale, offset=0)


def _bits(codec, kvh: int, d: int) -> float:
    return 8 * codec.bytes_per_token(kvh, d) / (kvh * d)


def _roundtrip(codec, x: mx.array) -> mx.array:
    return codec.decode(codec.encode(x))


def _pair_energy(q: np.ndarray, traditional: bool) -> np.ndarray:
    """Queries whose squares are each RoPE pair's mean energy: a pre-RoPE key channel
    meets a query rotated by its position, so over positions it sees its pair's average."""
    d = q.shape[-1]
    e = q.astype(np.float64) ** 2
    if traditional:
        pair = (e[..., 0::2] + e[..., 1::2]) / 2
        e = np.repeat(pair, 2, axis=-1)
    else:
        pair = (e[..., : d // 2] + e[..., d // 2 :]) / 2
        e = np.concatenate([pair, pair], axis=-1)
    return np.sqrt(e)


def allocated(q: np.ndarray, k: mx.array, mean: int) -> tuple[mx.array, float]:
    """Keys in calibration's allocated widths (q [H, T, D] sets the weights)."""
    codec = AllocatedCodec(allocate_widths(channel_weights(q, np.array(k[0]), GROUP), mean), GROUP)
    return _roundtrip(codec, k), _bits(codec, k.shape[1], k.shape[-1])


def joint(q: np.ndarray, k: mx.array, mean: int) -> tuple[mx.array, float]:
    """Widths allocated over every KV head's channels at once (a head may average more
    bits than another: per-KV-head choices), each head stored on its own."""
    kvh, d = k.shape[1], k.shape[-1]
    w = channel_weights(q, np.array(k[0]), GROUP)
    widths = allocate_widths(w.reshape(1, -1), mean)[0]
    heads = [AllocatedCodec((widths[h * d : (h + 1) * d],), GROUP) for h in range(kvh)]
    out = mx.concatenate([_roundtrip(c, k[:, h : h + 1]) for h, c in enumerate(heads)], axis=1)
    return out, sum(_bits(c, 1, d) for c in heads) / kvh


def pre_rope(q: np.ndarray, k: mx.array, mean: int, module) -> tuple[mx.array, float]:
    """Allocated widths on the keys before RoPE, RoPE applied again after decoding."""
    raw = rope(k, module, inverse=True)
    weights = channel_weights(_pair_energy(q, module.traditional), np.array(raw[0]), GROUP)
    codec = AllocatedCodec(allocate_widths(weights, mean), GROUP)
    return rope(_roundtrip(codec, raw), module), _bits(codec, k.shape[1], k.shape[-1])


def with_outliers(q: np.ndarray, k: mx.array, mean: int, n: int) -> tuple[mx.array, float]:
    """Each head's `n` highest-weight channels in fp16, the rest in allocated widths
    averaging `mean` bits."""
    kvh, d = k.shape[1], k.shape[-1]
    w = channel_weights(q, np.array(k[0]), GROUP)
    top = np.argsort(-w, axis=1, kind="stable")[:, :n]
    rest = np.array([[c for c in range(d) if c not in set(top[h])] for h in range(kvh)], dtype=np.int32)
    part = lambda x, idx: mx.take_along_axis(x, mx.array(idx)[None, :, None, :], axis=-1)  # noqa: E731
    codec = AllocatedCodec(allocate_widths(np.take_along_axis(w, rest, axis=1), mean), GROUP)
    out = mx.zeros_like(k)
    out = mx.put_along_axis(out, mx.array(rest)[None, :, None, :], _roundtrip(codec, part(k, rest)), axis=-1)
    out = mx.put_along_axis(out, mx.array(top.astype(np.int32))[None, :, None, :],
                            part(k, top).astype(mx.float16).astype(mx.float32), axis=-1)
    bits = (8 * codec.bytes_per_token(kvh, d - n) + kvh * n * 16) / (kvh * d)
    return out, bits


def qjl(k: mx.array, bits: int, seed: int = SKETCH_SEED) -> tuple[mx.array, float]:
    """TurboQuant's inner-product quantizer: the rotated codebook at `bits` - 1 and the
    residual r as sign(S r) and |r| (S Gaussian, d x d). The estimate of q . k is q . k_mse
    + |r| sqrt(pi / 2) / d (S q) . sign(S r), linear in q: the key it reads as is returned."""
    kvh, d = k.shape[1], k.shape[-1]
    base = RotatedCodec(bits - 1)
    k_mse = _roundtrip(base, k)
    r = k - k_mse
    S = mx.array(np.random.default_rng(seed).standard_normal((kvh, d, d)).astype(np.float32))
    signs = mx.sign(r @ S.swapaxes(-1, -2))  # [1, kvh, T, d]: sign(S r) per token
    norm = mx.sqrt((r * r).sum(axis=-1, keepdims=True)).astype(mx.float16).astype(mx.float32)
    estimate = k_mse + norm * math.sqrt(math.pi / 2) / d * (signs @ S)
    return estimate, bits + 32 / d  # codes, the signs, two fp16 norms


def key_codecs(q: np.ndarray, k: mx.array, module) -> dict[str, tuple[mx.array, float]]:
    """Every key codec of the study on one layer's keys: name -> (keys as read, bits/value)."""
    kvh, d = k.shape[1], k.shape[-1]
    out = {}
    for b in (3, 4, 5, 6):
        out[f"a{b}"] = allocated(q, k, b)
        out[f"pre{b}"] = pre_rope(q, k, b, module)
        if kvh > 1:
            out[f"j{b}"] = joint(q, k, b)
        out[f"o4a{b}"] = with_outliers(q, k, b, 4)
        out[f"r{b}"] = _roundtrip(RotatedCodec(b), k), _bits(RotatedCodec(b), kvh, d)
        out[f"qjl{b}"] = qjl(k, b)
        out[f"bound{b}"] = key_bound(q, k, b)
        for name, codec in ((f"c{b}", Codec(b, GROUP, per_channel=True)),
                            (f"cr{b}", Codec(b, GROUP, per_channel=True, rotated=True))):
            out[name] = _roundtrip(codec, k), _bits(codec, kvh, d)
    return out


def value_codecs(v: mx.array) -> dict[str, tuple[mx.array, float]]:
    """Every value codec of the study on one layer's values."""
    kvh, d = v.shape[1], v.shape[-1]
    out = {}
    for b in (3, 4, 5, 6):
        for name, codec in ((f"vr64-{b}", Codec(b, 64, rotated=True)), (f"v32-{b}", Codec(b, 32)),
                            (f"vlm-{b}", RotatedCodec(b))):
            if d % getattr(codec, "group_size", 1) == 0:
                out[name] = _roundtrip(codec, v), _bits(codec, kvh, d)
        out[f"vbound-{b}"] = value_bound(v, b)
    return out


def _rel(a: mx.array, ref: mx.array) -> float:
    return float(mx.sqrt(((a - ref) ** 2).sum() / (ref**2).sum()))


def study(model, tokenizer, max_tokens: int = 512) -> dict:
    """Per codec: bits per value and, per layer, the relative attention error with that
    side in the codec and the other exact."""
    from kvexec.calibrate import LAYOUT, TEXT
    from kvexec.layer_error import record

    ids = list(tokenizer.encode(TEXT.read_text(encoding="utf-8")))[:max_tokens]
    records, _ = record(model, ids, LAYOUT)
    modules = [layer.self_attn.rope for layer in model.layers]
    keys, values = {}, {}
    for rec, module in zip(records, modules, strict=True):
        q = mx.concatenate(rec.queries, axis=-2)
        k = mx.concatenate(rec.keys, axis=-2)
        v = mx.concatenate(rec.values, axis=-2)
        ref = attention(q, k, v, rec.scale, rec.window)
        qn = np.array(q[0])
        for name, (kq, bits) in key_codecs(qn, k, module).items():
            keys.setdefault(name, {"bits": bits, "errors": []})["errors"].append(
                _rel(attention(q, kq, v, rec.scale, rec.window), ref))
        for name, (vq, bits) in value_codecs(v).items():
            values.setdefault(name, {"bits": bits, "errors": []})["errors"].append(
                _rel(attention(q, k, vq, rec.scale, rec.window), ref))
    for side in (keys, values):
        for row in side.values():
            row["summed_squares"] = sum(e * e for e in row["errors"])
    return {"tokens": len(ids), "keys": keys, "values": values}


def family(name: str) -> str:
    """A codec's family: its name without the width ("pre5" -> "pre", "vr64-5" -> "vr64-")."""
    return name.rstrip("0123456789")


def bits_at(rows: list[dict], target: float) -> float:
    """Bits per value at which a family's summed squared error reaches `target`: its
    log-error interpolated linearly in bits between the measured widths that bracket it
    (extended past the ends along the nearest pair)."""
    pts = sorted((r["bits"], math.log(max(r["summed_squares"], 1e-300))) for r in rows)
    t = math.log(max(target, 1e-300))
    pairs = list(zip(pts, pts[1:]))
    (b0, e0), (b1, e1) = next((p for p in pairs if p[1][1] <= t <= p[0][1]), pairs[0] if t > pts[0][1] else pairs[-1])
    return b0 if e0 == e1 else b0 + (t - e0) * (b1 - b0) / (e1 - e0)


def savings(side: dict, baseline: str) -> dict[str, dict[str, float]]:
    """Per family, per width of `baseline`'s family: bits per value saved at the baseline's
    summed squared error there (negative: the family needs more)."""
    groups: dict[str, list[dict]] = {}
    for name, row in side.items():
        groups.setdefault(family(name), []).append(row)
    out = {}
    for fam, rows in groups.items():
        if fam == baseline or len(rows) < 2:
            continue
        out[fam] = {name: round(row["bits"] - bits_at(rows, row["summed_squares"]), 3)
                    for name, row in side.items() if family(name) == baseline}
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.report import publish
    from justfit import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = Engine(args.model)
    t0 = time.perf_counter()
    result = study(engine.model, engine.tokenizer, args.tokens)
    result.update(model=args.model, seconds=round(time.perf_counter() - t0, 1),
                  key_savings=savings(result["keys"], "a"), value_savings=savings(result["values"], "vr64-"))
    for side in ("keys", "values"):
        print(f"{side}: codec, bits/value, summed squared attention error over layers")
        for name, row in sorted(result[side].items(), key=lambda kv: kv[1]["bits"]):
            print(f"  {name:8s} {row['bits']:.3f}  {row['summed_squares']:.3e}")
        saved = result["key_savings" if side == "keys" else "value_savings"]
        print(f"{side}: bits per value saved against the default's codec at its error, by its width")
        for fam, row in saved.items():
            print(f"  {fam:8s} " + "  ".join(f"{k}: {v:+.2f}" for k, v in row.items()))
    publish(f"codecs-{args.model}", result, args.json)


if __name__ == "__main__":
    main()

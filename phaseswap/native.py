"""The native resident form: the stored affine-quantized weights (4, 5, 6 or 8 bits, as the
GGUF import or mlx-lm leaves them) computed by JustFit's own CPU kernel
(`native/qmatvec.cpp`, built by `./dev setup` into the `justfit_native` package).

MLX's CPU `quantized_matmul` runs the stored layout several times slower than q8t and
computes each row of a batch on its own; the native kernel reads each weight once for
all rows, so decode runs on the stored bytes (no re-quantization: the stored values
exactly, up to float summation order) and a batched step costs little more than one
row. Where the kernel is not built, or off the CPU, or the weights are in another
quantization, the layers stay in MLX's own forms (see `to_native`)."""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn


@functools.cache
def kernels():
    """The built extension module, or None: not built, or off (JUSTFIT_NATIVE=0; see
    justfit.runtime.native_kernels, which says which once). Looked up once: a decode step
    asks a few hundred times."""
    try:
        from justfit_native import kernels as native_kernels
    except ImportError:
        return None
    return native_kernels()


def available() -> bool:
    """Whether the native kernel can run here (built, and MLX computes on the CPU)."""
    return kernels() is not None and mx.default_device() == mx.cpu


def eligible(mod: nn.Module) -> bool:
    """Whether `mod` holds weights the kernel computes: affine 4-, 5-, 6- or 8-bit (a GGUF's
    Q5_0 and Q5_K are 5-bit), groups of 32k."""
    return (isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and getattr(mod, "mode", "affine") == "affine"
            and mod.bits in getattr(kernels(), "MATVEC_BITS", (4, 8))
            and mod.group_size % 32 == 0 and mod.group_size <= 256)


def native_dequantize(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
                      mode: str = "affine") -> mx.array | None:
    """mx.dequantize in float32 through the native kernel (MLX's CPU dequantize unpacks a
    5-bit matrix bit by bit, far slower), or None where it does not
    apply. Scales and biases as stored: float16 ones widen exactly."""
    # weights the native forms hold (the widths the matvec reads); others keep MLX's
    if kernels() is None or mode != "affine" or biases is None or bits not in getattr(kernels(), "MATVEC_BITS", ()):
        return None
    from justfit_native import dequantize

    return dequantize(weight, scales, biases, group_size, bits)


# The native form keeps the scales and biases as stored (float16 from a GGUF or mlx-lm:
# a quarter fewer bytes than float32 casts of them at 4 bits), and computes in float32.
SCALE_DTYPES = (mx.float16, mx.float32)


def _matvec(x: mx.array, mod: nn.Module) -> mx.array | None:
    """x @ W^T through the kernel, or None where it does not apply (the caller falls back).
    A form made with rounded activations rounds x's blocks of 32 first (see to_native)."""
    ext = kernels()
    if (ext is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu
            or mod["scales"].dtype not in SCALE_DTYPES):
        return None
    return ext.quantized_matvec(x, mod["weight"], mod["scales"], mod["biases"], mod.group_size, mod.bits,
                                activation_bits=mod.__dict__.get("activation_bits", 32))


def _fallback(x: mx.array, mod: nn.Module) -> mx.array:
    """MLX's own kernel, the scales in x's dtype (MLX computes in theirs)."""
    return mx.quantized_matmul(x, mod["weight"], mod["scales"].astype(x.dtype), mod["biases"].astype(x.dtype),
                               transpose=True, group_size=mod.group_size, bits=mod.bits)


def stored_arrays(mods: list[nn.Module] | tuple) -> tuple[list, list, list]:
    """The weights, scales and biases of native linears, as quantized_matvecs takes them."""
    return [m["weight"] for m in mods], [m["scales"] for m in mods], [m["biases"] for m in mods]


def products_args(mods: list[nn.Module]) -> tuple[tuple, dict]:
    """quantized_matvecs' arguments for native linears of one input width, group size,
    activation rounding and scales dtype: (positional, keywords), x aside."""
    first = mods[0]
    return ((*stored_arrays(mods), first.group_size, [m.bits for m in mods]),
            {"activation_bits": first.__dict__.get("activation_bits", 32)})


def _products(ext, x: mx.array, mods: list[nn.Module], **steps) -> list[mx.array]:
    """The kernel's products of x with native linears of one input width, group size,
    activation rounding and scales dtype, as one operation (with `steps` fused)."""
    args, settings = products_args(mods)
    return ext.quantized_matvecs(x, *args, **settings, **steps)


class _Joint:
    """Sibling native linears applied to one x (a layer's q, k and v projections; gate and
    up) as one operation: the first sibling called with a new x computes every sibling's
    product, the others take theirs. It holds that x and the products not yet taken,
    and lets go of both once all are (mlx-lm's layers call each sibling once per x)."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.x: mx.array | None = None
        self.ready: dict[int, mx.array] = {}

    def product(self, mod: nn.Module, x: mx.array) -> mx.array | None:
        """`mod`'s x @ W^T, or None where the kernel cannot take x (the caller falls back)."""
        if self.x is not x or id(mod) not in self.ready:
            ext = kernels()
            if ext is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
                return None
            ys = _products(ext, x, self.members)
            self.x, self.ready = x, {id(m): y for m, y in zip(self.members, ys)}
        y = self.ready.pop(id(mod))
        if not self.ready:
            self.x = None
        return y


def fused_group(mod: nn.Module) -> list[nn.Module] | None:
    """`mod` and the siblings it was joined with (join_siblings), in their order, where
    the kernel can take their products with fused steps (quantized_matvecs'); else None
    (not a native linear, a bias, scales of another dtype)."""
    if not isinstance(mod, NativeQuantizedLinear):
        return None
    joint = mod.__dict__.get("_joint")
    mods = joint.members if joint is not None else [mod]
    if mod["scales"].dtype not in SCALE_DTYPES or any("bias" in m for m in mods):
        return None
    return mods


# Siblings mlx-lm's layers apply to the same input one after another.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def join_siblings(module: nn.Module) -> int:
    """Let each group of SIBLINGS in `module` that are native linears of one input width,
    group size, activation rounding and scales dtype (bit widths may differ) compute as one operation
    (each costs MLX's dispatch at decode, more than a small product's arithmetic);
    how many groups were joined."""
    joined = 0
    for _, parent in module.named_modules():
        for names in SIBLINGS:
            members = [parent.get(n) if isinstance(parent, dict) else None for n in names]
            if not all(isinstance(m, NativeQuantizedLinear) for m in members):
                continue
            first = members[0]
            same = lambda m: (m.group_size, m["weight"].shape[1] * 32 // m.bits, m["scales"].dtype,  # noqa: E731
                              m.__dict__.get("activation_bits", 32))
            if all(same(m) == same(first) for m in members) and first["scales"].dtype in SCALE_DTYPES:
                joint = _Joint(members)
                for m in members:
                    m.__dict__["_joint"] = joint  # not a parameter: kept out of the module's tree
                joined += 1
    return joined


class NativeQuantizedLinear(nn.QuantizedLinear):
    """A stored quantized linear computed by the native kernel (same parameters, same layout)."""

    def __call__(self, x: mx.array) -> mx.array:
        joint = self.__dict__.get("_joint")
        y = joint.product(self, x) if joint is not None else _matvec(x, self)
        if y is None:
            y = _fallback(x, self)
        return y + self["bias"].astype(y.dtype) if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A stored quantized embedding whose use as the tied output head runs the native kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        """The rows of `x`, dequantized in float32 (exact: float16 scales widen exactly)."""
        return mx.dequantize(self["weight"][x], self["scales"][x].astype(mx.float32),
                             self["biases"][x].astype(mx.float32), group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied output head: x @ E^T."""
        y = _matvec(x, self)
        return _fallback(x, self) if y is None else y


def is_native(mod: nn.Module) -> bool:
    """Whether `mod` is one of the native forms."""
    return isinstance(mod, (NativeQuantizedLinear, NativeQuantizedEmbedding))


def _recast(mod: nn.Module, cls: type, **settings) -> nn.Module:
    """A new module of `cls` holding the same arrays and settings as `mod` (nothing copied),
    plus `settings` (kept out of the module's tree)."""
    new = cls.__new__(cls)
    new.__dict__.update(mod.__dict__)
    new.__dict__.update(settings)
    dict.update(new, dict(mod))
    return new


def rounded_available() -> bool:
    """Whether the built kernel multiplies rounded (int8, int16) activations (AVX2);
    elsewhere it computes in float32."""
    ext = kernels()
    return ext is not None and bool(getattr(ext, "ROUNDED_ACTIVATIONS", ()))


def to_native(mod: nn.Module, activation_bits: int = 32) -> nn.Module | None:
    """`mod` in the native form, or None when the kernel cannot compute it. With
    `activation_bits` 8 or 16 its products round each input row's blocks of 32 to that
    many bits (at the block's largest magnitude) and multiply in integers: 8 as llama.cpp
    does with its q8 activation blocks, 16 far closer to float32. The weights are the stored ones either way."""
    if not eligible(mod):
        return None
    cls = NativeQuantizedEmbedding if isinstance(mod, nn.QuantizedEmbedding) else NativeQuantizedLinear
    return _recast(mod, cls, activation_bits=activation_bits if rounded_available() else 32)


class NativeRoPE(nn.RoPE):
    """nn.RoPE whose float32 CPU path is the native kernel: one operation where MLX's
    CPU fallback for mx.fast.rope makes about twenty (two calls a layer each token). Same angles: MLX's inverse frequencies, float32."""

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        ext = kernels()
        if ext is None or x.dtype != mx.float32 or not isinstance(offset, int) or mx.default_device() != mx.cpu:
            return super().__call__(x, offset)  # e.g. a batch's per-row offsets (an array)
        return ext.rope(x, self.inv_freqs(), self.dims, traditional=self.traditional, scale=self.scale, offset=offset)

    def inv_freqs(self) -> mx.array:
        """MLX's inverse frequencies for these dims and base, float32 (made once)."""
        if "_inv_freqs" not in self.__dict__:  # not a parameter: kept out of the module's tree
            half = self.dims // 2
            self.__dict__["_inv_freqs"] = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(self.base) / half))
        return self.__dict__["_inv_freqs"]


def native_rms_norm(x: mx.array, weight: mx.array, eps: float, weight_offset: float = 0.0) -> mx.array | None:
    """mx.fast.rms_norm(x, weight + weight_offset, eps) as one native operation, or None
    where it does not apply (not float32, not the CPU, no kernels)."""
    ext = kernels()
    if ext is None or x.dtype != mx.float32 or weight.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    return ext.rms_norm(x, weight, eps, weight_offset=weight_offset)


class NativeRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose float32 CPU path is the native kernel: one operation where MLX's
    CPU fallback for mx.fast.rms_norm makes five or six."""

    def __call__(self, x: mx.array) -> mx.array:
        y = native_rms_norm(x, self["weight"], self.eps)
        return super().__call__(x) if y is None else y


_NATIVE_OPS = {nn.RoPE: NativeRoPE, nn.RMSNorm: NativeRMSNorm}


def install_ops(model: nn.Module) -> int:
    """Give `model`'s plain rotary embeddings and RMS norms (nn.RoPE and nn.RMSNorm
    exactly: variants, such as Gemma's 1 + weight norm, keep MLX's) the native kernels;
    how many were. Nothing where the kernels are not built."""
    return len(replace_ops(model))


def replace_ops(model: nn.Module) -> list[tuple]:
    """`install_ops`, each replacement as (container, key, original, native): what
    justfit.model.adapter puts back when it removes them."""
    if kernels() is None:
        return []
    done = []
    for _, mod in model.named_modules():
        for name, value in list(mod.items()):  # a Module is a dict of its members
            if isinstance(value, list):  # e.g. nn.Sequential's layers
                for i, c in enumerate(value):
                    if type(c) in _NATIVE_OPS:
                        value[i] = _recast(c, _NATIVE_OPS[type(c)])
                        done.append((value, i, c, value[i]))
            elif type(value) in _NATIVE_OPS:
                mod[name] = _recast(value, _NATIVE_OPS[type(value)])
                done.append((mod, name, value, mod[name]))
    return done

"""The forms a linear weight can take, and the conversions between them.

* stored: what the model folder holds (`nn.QuantizedLinear` / `nn.Linear` / embeddings).
* dense: fp32 `nn.Linear`, a working copy for compute-bound phases. On MLX's CPU
  backend a dequantized GEMM through OpenBLAS runs far faster than `quantized_matmul`.
* q8t: the weight transposed to [in, out] and quantized at 8 bits along `out`.
  MLX's CPU quantized matvec is several times faster with this layout (transpose=False) than
  with the stored one, and beats a dense fp32 matvec while taking 1.25 bytes/weight:
  the compact form for memory-bound decode on CPU. Re-quantizing is not exact.
* grouped: exact for affine-quantized weights. The stored integer grid, transposed per
  input group and packed at 8 bits under unit scales (so the fast untransposed matvec
  reproduces it exactly), and the stored scales and biases applied per group after:
  y = sum_g s_g * (x_g Q_g^T) + b_g * sum(x_g). 1.5 bytes/weight, somewhat slower than q8t.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx.utils import tree_flatten

from phaseswap.native import native_dequantize

Q8T_GROUP = 32
LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)


class TransposedQuantizedLinear(nn.Module):
    """y = x @ W^T + bias with W^T stored [in, out], quantized along out (see module doc)."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array,
                 bias: mx.array | None, group_size: int, bits: int):
        super().__init__()
        self.weight, self.scales, self.biases = weight, scales, biases
        if bias is not None:
            self.bias = bias
        self.group_size, self.bits = group_size, bits
        self.freeze()

    def _extra_repr(self) -> str:
        return f"in={self.weight.shape[0]}, out={self.scales.shape[1] * self.group_size}, bits={self.bits}"

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.quantized_matmul(x, self["weight"], self["scales"], self["biases"], transpose=False,
                                group_size=self.group_size, bits=self.bits)
        return y + self["bias"] if "bias" in self else y

    def dequantized_t(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """W^T, [in, out]."""
        return mx.dequantize(self["weight"], self["scales"].astype(dtype), self["biases"].astype(dtype),
                             group_size=self.group_size, bits=self.bits).astype(dtype)


class GroupedQuantizedLinear(nn.Module):
    """The exact decode form of an affine-quantized linear (see module doc)."""

    def __init__(self, grid: mx.array, scales: mx.array, biases: mx.array, bias: mx.array | None,
                 group_size: int):
        super().__init__()
        groups, _, packed = grid.shape
        self.weight = grid  # [G, group_size, out / 4] uint32: the integer grid at 8 bits
        self.unit_scales = mx.ones((groups, group_size, packed * 4 // Q8T_GROUP))
        self.unit_biases = mx.zeros_like(self.unit_scales)
        self.scales, self.biases = scales, biases  # [G, out]
        if bias is not None:
            self.bias = bias
        self.group_size = group_size
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        lead, groups = x.shape[:-1], self["scales"].shape[0]
        xg = x.reshape(-1, groups, self.group_size).swapaxes(0, 1)  # [G, n, group]
        part = mx.quantized_matmul(xg, self["weight"], self["unit_scales"], self["unit_biases"],
                                   transpose=False, group_size=Q8T_GROUP, bits=8)
        y = (part * self["scales"][:, None, :]).sum(axis=0) + xg.sum(axis=-1).T @ self["biases"]
        y = y.reshape(*lead, y.shape[-1])
        return y + self["bias"] if "bias" in self else y

    def dequantized_t(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """W^T, [in, out]."""
        grid = mx.dequantize(self["weight"], self["unit_scales"], self["unit_biases"], group_size=Q8T_GROUP, bits=8)
        wt = grid * self["scales"][:, None, :] + self["biases"][:, None, :]
        return wt.reshape(-1, wt.shape[-1]).astype(dtype)


def to_grouped(mod: nn.Module) -> nn.Module:
    """The exact decode form of an affine-quantized linear or embedding (as the head);
    `mod` unchanged when it is not affine-quantized or its shape does not allow it."""
    if not isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or getattr(mod, "mode", "affine") != "affine" \
            or "biases" not in mod or mod.bits > 8:
        return mod
    out = mod["weight"].shape[0]
    if out % Q8T_GROUP:
        return mod
    gs = mod.group_size
    ones = mx.ones(mod["scales"].shape)
    grid = mx.dequantize(mod["weight"], ones, mx.zeros_like(ones), group_size=gs, bits=mod.bits)
    q = np.asarray(grid.astype(mx.uint8))  # [out, in], exact small integers
    groups = q.shape[1] // gs
    qt = np.ascontiguousarray(q.T.reshape(groups, gs, out))
    packed = mx.array(qt.view(np.uint32))  # little-endian: element j in byte j % 4, as MLX packs 8 bits
    bias = _bias(mod, mx.float32) if isinstance(mod, nn.QuantizedLinear) else None
    g = GroupedQuantizedLinear(packed, mod["scales"].astype(mx.float32).T, mod["biases"].astype(mx.float32).T,
                               bias, gs)
    mx.eval(g.parameters())
    return g


def dense_weight(mod: nn.Module, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The [out, in] weight of any linear form (or [vocab, hidden] of an embedding), lazily."""
    if isinstance(mod, GroupedQuantizedLinear):
        return mod.dequantized_t(dtype).T
    if isinstance(mod, TransposedQuantizedLinear):
        return mod.dequantized_t(dtype).T
    if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return _dequantized(mod, mod["weight"], mod["scales"], mod.get("biases"), dtype)
    return mod["weight"].astype(dtype)


def _dequantized(mod: nn.Module, weight: mx.array, scales: mx.array, biases: mx.array | None,
                 dtype: mx.Dtype = mx.float32) -> mx.array:
    """`mod`'s quantized weight (or rows of it) in `dtype`; the native kernel where it applies."""
    mode = getattr(mod, "mode", "affine")
    if dtype == mx.float32:
        native = native_dequantize(weight, scales, biases, mod.group_size, mod.bits, mode)
        if native is not None:
            return native
    # Scales and biases are widened first: dequantizing in fp16 would round
    # scale * q + bias to fp16 before the cast, losing the source's exactness.
    return mx.dequantize(weight, scales.astype(dtype), None if biases is None else biases.astype(dtype),
                         group_size=mod.group_size, bits=mod.bits, mode=mode).astype(dtype)


def _bias(mod: nn.Module, dtype: mx.Dtype) -> mx.array | None:
    return mod["bias"].astype(dtype) if "bias" in mod else None


def _bare(cls: type[nn.Module]) -> nn.Module:
    """An mlx.nn layer with no parameters yet. Its own __init__ would draw weights from
    MLX's global random key, which nothing here evaluates: each draw lengthens the key's
    lazy graph (memory kept for every layer made, and prefill makes dense copies of
    every linear per chunk)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    return module


def to_dense(mod: nn.Module, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """A dense working copy of a linear or embedding (lazy: nothing computed until used)."""
    weight = dense_weight(mod, dtype)
    if isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding)):
        dense = _bare(nn.Embedding)
    else:
        dense = _bare(nn.Linear)
        if "bias" in mod:
            dense.bias = _bias(mod, dtype)
    dense.weight = weight
    return dense


class DenseWhileUsed(nn.Module):
    """A linear's dense working copy made when it is called and dropped with its
    product, which is evaluated at once: a layer's prefill then holds one dense weight
    at a time. Held copies (`to_dense`) of every linear in a layer would all exist
    together, since MLX evaluates them before the first product. Same products, bit for
    bit, as the held copy."""

    def __init__(self, mod: nn.Module):
        super().__init__()
        self.__dict__["stored"] = mod  # not a child module: the lease's parameters are none of its own

    def __call__(self, x: mx.array) -> mx.array:
        mx.eval(x)  # what x is computed from is freed before the dense copy exists
        y = to_dense(self.__dict__["stored"])(x)
        mx.eval(y)
        return y


def _dense_rows(mod: nn.Module, start: int, end: int) -> mx.array:
    """Rows start:end of the [out, in] weight, fp32, dequantizing only those rows."""
    if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        biases = mod.get("biases")
        return _dequantized(mod, mod["weight"][start:end], mod["scales"][start:end],
                            None if biases is None else biases[start:end])
    return mod["weight"][start:end].astype(mx.float32)


def to_q8t(mod: nn.Module, block: int = 4096) -> nn.Module:
    """The decode form of a linear (or of an embedding used as the output head);
    returns `mod` unchanged when its output size does not split into groups. Converted
    `block` output rows at a time: a 49K-row head would otherwise need its whole fp32
    weight (and a transposed copy) at once, the largest transient of a model load."""
    out = mod["weight"].shape[0]
    if out % Q8T_GROUP:
        return mod
    parts = []
    for start in range(0, out, block):
        part = mx.quantize(_dense_rows(mod, start, min(out, start + block)).T, Q8T_GROUP, 8)
        mx.eval(part)
        parts.append(part)
    weight, scales, biases = (mx.concatenate([p[i] for p in parts], axis=-1) for i in range(3))
    bias = _bias(mod, mx.float32) if not isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding)) else None
    q = TransposedQuantizedLinear(weight, scales, biases, bias, Q8T_GROUP, 8)
    mx.eval(q.parameters())
    return q


def is_linear(mod: nn.Module) -> bool:
    """Whether `mod` is a linear layer in any form PhaseSwap handles (dense, quantized, q8t, grouped)."""
    return isinstance(mod, (*LINEAR_TYPES, TransposedQuantizedLinear, GroupedQuantizedLinear))


def module_bytes(mod: nn.Module) -> int:
    """Bytes of `mod`'s parameters as they are held."""
    return sum(v.nbytes for _, v in tree_flatten(mod.parameters()))


def dense_bytes(mod: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Bytes of `to_dense(mod)` (shapes only; nothing is computed)."""
    if isinstance(mod, GroupedQuantizedLinear):
        n = mod["weight"].size * 4
    elif isinstance(mod, TransposedQuantizedLinear):
        n = mod["scales"].size * mod.group_size
    elif isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        n = mod["weight"].size * 32 // mod.bits
    else:
        n = mod["weight"].size
    return (n + (mod["bias"].size if "bias" in mod else 0)) * dtype.size


class TiedEmbedding(nn.Module):
    """An input embedding whose transpose is the output head, split in two so the
    head can take its own form (q8t on CPU) while lookups keep the stored table."""

    def __init__(self, lookup: nn.Module, head: nn.Module):
        super().__init__()
        self.lookup = lookup
        self.head = head

    def __call__(self, x: mx.array) -> mx.array:
        return self.lookup(x)

    def as_linear(self, x: mx.array) -> mx.array:
        """The output head applied to `x`: what mlx-lm calls for a tied model's logits."""
        return self.head(x)


def materialize_dense(model: nn.Module, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Every linear and embedding dense in `dtype`, every float parameter cast, in place
    and evaluated (the whole-model form references and parity checks use)."""
    swaps = [(path, to_dense(mod, dtype)) for path, mod in model.named_modules()
             if is_linear(mod) or isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding))]
    for path, dense in swaps:
        set_module(model, path, dense)
    model.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a)
    mx.eval(model.parameters())
    return model


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The submodule of `root` at dotted `path` (list items by index; an empty path is `root`)."""
    mod = root
    for part in path.split(".") if path else []:
        mod = mod[int(part)] if isinstance(mod, list) else mod[part]
    return mod


def set_module(root: nn.Module, path: str, value: nn.Module) -> None:
    """Replace the submodule of `root` at dotted `path` with `value`."""
    parent_path, _, last = path.rpartition(".")
    parent = get_module(root, parent_path)
    if isinstance(parent, list):
        parent[int(last)] = value
    else:
        setattr(parent, last, value)

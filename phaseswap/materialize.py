"""Turn quantized modules into dense ones of a compute dtype.

On MLX's CPU backend `quantized_matmul` runs at a few GFLOP/s while a dequantized
fp32 GEMM through OpenBLAS runs at hundreds, so CPU compute uses dense fp32 weights.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path


def _dequantized(mod: nn.Module, dtype: mx.Dtype) -> mx.array:
    # Scales and biases are widened first: dequantizing in fp16 would round
    # scale * q + bias to fp16 before the cast, losing the source's exactness.
    biases = mod.get("biases")
    return mx.dequantize(
        mod.weight, mod.scales.astype(dtype), None if biases is None else biases.astype(dtype),
        group_size=mod.group_size, bits=mod.bits, mode=getattr(mod, "mode", "affine"),
    ).astype(dtype)


def _dense_module(_path: str, mod: nn.Module, dtype: mx.Dtype) -> nn.Module:
    if isinstance(mod, nn.QuantizedLinear):
        weight = _dequantized(mod, dtype)
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in mod)
        dense.weight = weight
        if "bias" in mod:
            dense.bias = mod.bias.astype(dtype)
        return dense
    if isinstance(mod, nn.QuantizedEmbedding):
        weight = _dequantized(mod, dtype)
        dense = nn.Embedding(weight.shape[0], weight.shape[1])
        dense.weight = weight
        return dense
    return mod


def materialize_dense(model: nn.Module, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Replace every quantized linear/embedding by a dense one and cast all float
    parameters to `dtype`, in place; evaluates so the quantized copies are freed."""
    leaves = model.leaf_modules()
    model.update_modules(
        tree_map_with_path(lambda p, m: _dense_module(p, m, dtype), leaves, is_leaf=nn.Module.is_module)
    )
    model.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a)
    mx.eval(model.parameters())
    return model


def dense_bytes(model: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Bytes the model's parameters would take once materialized densely in `dtype`."""
    total = 0
    for path, mod in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = mod.weight.shape
            total += rows * packed * 32 // mod.bits * dtype.size
            if "bias" in mod:
                total += mod.bias.size * dtype.size
        else:
            total += sum(v.size * dtype.size for _, v in tree_flatten(mod.parameters()))
    return total

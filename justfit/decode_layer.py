"""mlx-lm's llama attention layer, as a CPU decode step with native forms runs it.

mlx-lm's layer makes about twenty MLX operations a call: three projections, a reshape
and a transpose for each, two rotations, the attention and a transpose and reshape of
its output. At decode on the CPU each costs MLX's dispatch (~6 us here), more than its
arithmetic. With the native kernels and a paged cache the same layer makes four:
the joined q/k/v projection (phaseswap.native.join_siblings), heads split and rotated
in one (native/heads.cpp), KVExec's attention written in the output projection's
layout, the output projection. Same arithmetic; anything else (another cache, a
scaled rotary embedding, float16, Metal) runs mlx-lm's own code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from kvexec import PagedKVCache
from phaseswap.native import NativeRoPE, kernels


def _native_call(layer: llama.Attention, x: mx.array, cache) -> mx.array | None:
    """The layer's output through the native path, or None where it does not apply."""
    ext = kernels()
    if (ext is None or not hasattr(ext, "rope_heads") or type(cache) is not PagedKVCache
            or type(layer.rope) is not NativeRoPE or x.dtype != mx.float32 or mx.default_device() != mx.cpu):
        return None
    rope = layer.rope
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    q, k, v = ext.rope_heads(q, k, v, layer.n_heads, layer.n_kv_heads, rope.inv_freqs(), rope.dims,
                             traditional=rope.traditional, scale=rope.scale, offset=cache.offset)
    cache.update_and_fetch(k, v)
    return layer.o_proj(cache.attend(q, layer.scale, tokens_major=True))


class NativeLlamaAttention(llama.Attention):
    """mlx-lm's llama attention (same parameters) taking the native path where it applies."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        out = _native_call(self, x, cache)
        return super().__call__(x, mask, cache) if out is None else out


def install_native_attention(model: nn.Module) -> int:
    """Give `model`'s llama attention layers (exactly mlx-lm's class) the native path;
    how many were."""
    count = 0
    for _, mod in model.named_modules():
        if type(mod) is llama.Attention:
            mod.__class__ = NativeLlamaAttention
            count += 1
    return count

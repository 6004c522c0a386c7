"""mlx-lm's llama attention and gated MLPs (llama, Gemma 3) with JustFit's CPU kernels.

mlx-lm's layer makes about twenty MLX operations a call: three projections, a reshape
and a transpose for each, two rotations, the attention and a transpose and reshape of
its output. At decode on the CPU each costs MLX's dispatch, more than its
arithmetic. With the native kernels and a paged cache the same layer makes four:
the joined q/k/v projection (phaseswap.native.join_siblings), heads split and rotated
in one (native/heads.cpp), KVExec's attention written in the output projection's
layout, the output projection. Same arithmetic; anything else (another cache, a
scaled rotary embedding, float16, Metal) runs mlx-lm's own code.

The gated MLPs' activation (silu(gate) * up, gelu_approx(gate) * up) is one native
operation with vector exponentials on both cores (native/gated.cpp): MLX's compiled
CPU version computes one element at a time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.activations import swiglu

from kvexec import PagedKVCache
from kvexec.batch_cache import BatchLayerCache
from phaseswap.native import NativeRoPE, fused_group, kernels, native_rms_norm, products_args, stored_arrays


def _heads_settings(layer: llama.Attention | gemma3_text.Attention, x: mx.array, cache, norms: tuple | None):
    """rope_heads' settings for the layer's native path, or None where it does not apply.
    `norms`: Gemma's per-head q and k norms (the 1 + weight kind), applied before rotation."""
    ext = kernels()
    if (ext is None or not hasattr(ext, "rope_heads") or type(cache) is not PagedKVCache
            or type(layer.rope) is not NativeRoPE or x.dtype != mx.float32 or mx.default_device() != mx.cpu):
        return None
    if norms is None:
        return {}
    return _head_norms(*norms) if _head_norms_fit(*norms) else None


def _head_norms_fit(q_norm: nn.Module, k_norm: nn.Module) -> bool:
    """Whether rope_heads can apply Gemma's per-head q and k norms (one eps, float32)."""
    return q_norm.eps == k_norm.eps and q_norm["weight"].dtype == mx.float32 and k_norm["weight"].dtype == mx.float32


def _head_norms(q_norm: nn.Module, k_norm: nn.Module) -> dict:
    """rope_heads' keywords for Gemma's per-head q and k norms (the 1 + weight kind)."""
    return {"norms": (q_norm["weight"], k_norm["weight"]), "norm_eps": q_norm.eps, "norm_offset": 1.0}


def _attend(layer: llama.Attention | gemma3_text.Attention, q: mx.array, k: mx.array, v: mx.array, cache,
            settings: dict) -> mx.array:
    """The projections' heads split and rotated in one operation, stored, and attended
    over the pages: [B, L, heads * D], the output projection's input."""
    rope = layer.rope
    q, k, v = kernels().rope_heads(q, k, v, layer.n_heads, layer.n_kv_heads, rope.inv_freqs(), rope.dims,
                                   traditional=rope.traditional, scale=rope.scale, offset=cache.offset, **settings)
    cache.update_and_fetch(k, v)
    return cache.attend(q, layer.scale, tokens_major=True)


def _native_call(layer: llama.Attention | gemma3_text.Attention, x: mx.array, cache,
                 norms: tuple | None = None) -> mx.array | None:
    """The layer's output through the native path, or None where it does not apply."""
    settings = _heads_settings(layer, x, cache, norms)
    if settings is None:
        return None
    return layer.o_proj(_attend(layer, layer.q_proj(x), layer.k_proj(x), layer.v_proj(x), cache, settings))


class NativeLlamaAttention(llama.Attention):
    """mlx-lm's llama attention (same parameters) taking the native path where it applies."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        out = _native_call(self, x, cache)
        return super().__call__(x, mask, cache) if out is None else out


class NativeGemmaAttention(gemma3_text.Attention):
    """mlx-lm's Gemma 3 attention (same parameters) taking the native path where it applies:
    q/k norms, rotation and the heads' layout in one operation."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        out = _native_call(self, x, cache, (self.q_norm, self.k_norm))
        return super().__call__(x, mask, cache) if out is None else out


class NativeGemmaRMSNorm(gemma3_text.RMSNorm):
    """Gemma 3's RMS norm (x scaled by 1 + weight) as one native operation where it applies
    (MLX's CPU fallback for mx.fast.rms_norm makes five or six, and 1 + weight one more)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = native_rms_norm(x, self["weight"], self.eps, weight_offset=1.0)
        return super().__call__(x) if y is None else y


_SILU, _GELU_APPROX = 0, 1  # native/gated.h's kinds


def _gated(gate: mx.array, up: mx.array, kind: int) -> mx.array | None:
    """act(gate) * up through the native kernel, or None where it does not apply."""
    ext = kernels()
    if (ext is None or not hasattr(ext, "gated_activation") or gate.dtype != mx.float32 or up.dtype != mx.float32
            or mx.default_device() != mx.cpu):
        return None
    return ext.gated_activation(gate, up, kind)


class NativeLlamaMLP(llama.MLP):
    """mlx-lm's llama MLP (same parameters) with the native SwiGLU where it applies."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        h = _gated(gate, up, _SILU)
        h = swiglu(gate, up) if h is None else h
        del gate, up  # freed once h is computed, before the down projection's dense copy and output
        return self.down_proj(h)


class NativeGemmaMLP(gemma3_text.MLP):
    """mlx-lm's Gemma 3 MLP (same parameters) with the native GELU gate where it applies."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        h = _gated(gate, up, _GELU_APPROX)
        h = nn.gelu_approx(gate) * up if h is None else h
        del gate, up  # as above
        return self.down_proj(h)


_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = _NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _modules(block: llama.TransformerBlock | gemma3_text.TransformerBlock, gemma: bool) -> tuple:
    """The modules a decoder layer's fused steps read, looked up in the modules' dicts
    by C-level maps (an nn.Module's attribute lookup is slow in a hot loop): their ids tell
    whether `_BlockSteps` still holds."""
    attn, mlp = block["self_attn"], block["mlp"]
    found = (attn, mlp, *map(attn.get, _ATTENTION_PARTS), *map(mlp.get, _MLP_PARTS),
             *map(block.get, _GEMMA_NORMS if gemma else _NORMS))
    return found + (attn["q_norm"], attn["k_norm"]) if gemma else found


@dataclass(frozen=True)
class _Step:
    """One fused step's linears and quantized_matvecs' settings (the arrays are read from
    the linears at each call: PhaseSwap may lease others for a call)."""

    linears: tuple
    settings: tuple  # group_size, bits
    keywords: dict   # activation rounding, norm eps and offset, gate

    def __call__(self, x: mx.array, **arrays) -> list[mx.array]:
        return kernels().quantized_matvecs(x, *stored_arrays(self.linears), *self.settings, **self.keywords, **arrays)


@dataclass(frozen=True)
class _BlockSteps:
    """A decoder layer's fused native steps with their settings gathered once (gathering
    them every decode step was a large share of a layer's graph building):
    kept while the layer holds the same modules (`_modules`, held here so that no id is
    reused while it is compared; they are the layer's own)."""

    modules: tuple
    qkv: _Step
    o: _Step
    gate_up: _Step
    down: _Step
    norms: tuple  # the layer's norms (Gemma: four; llama: two), their weights read at each call
    gemma: bool

    def heads(self) -> dict:
        """rope_heads' keywords: Gemma's per-head q and k norms."""
        return _head_norms(*self.modules[-2:]) if self.gemma else {}


def _block_steps(block: llama.TransformerBlock | gemma3_text.TransformerBlock, gemma: bool,
                 modules: tuple) -> _BlockSteps | None:
    """The layer's fused steps, or None where they do not apply (a linear that is not
    native or not joined with its siblings, a bias, norms of another dtype or eps)."""
    attn, mlp = block.self_attn, block.mlp
    norms = tuple(block[name] for name in (_GEMMA_NORMS if gemma else _NORMS))
    groups = [fused_group(m) for m in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj)]
    if ([len(g) if g else 0 for g in groups] != [3, 1, 2, 1]
            or any(n["weight"].dtype != mx.float32 or n.eps != norms[0].eps for n in norms)):
        return None
    if gemma and not _head_norms_fit(attn.q_norm, attn.k_norm):
        return None
    fused = {"norm_eps": norms[0].eps, "norm_offset": 1.0 if gemma else 0.0}

    def step(mods, **extra):
        (_, _, _, group_size, bits), keywords = products_args(mods)
        return _Step(tuple(mods), (group_size, bits), {**keywords, **fused, **extra})

    qkv, o, gate_up, down = groups
    gate = _GELU_APPROX if gemma else _SILU
    return _BlockSteps(modules, step(qkv), step(o), step(gate_up, gate=gate), step(down), norms, gemma)


def _steps_for(block: llama.TransformerBlock | gemma3_text.TransformerBlock, gemma: bool) -> _BlockSteps | None:
    """The layer's `_BlockSteps`, made again when its modules changed (nothing is kept
    where the steps do not apply: e.g. prefill's leased dense linears, which must go
    when their lease ends)."""
    modules = _modules(block, gemma)
    kept = block.__dict__.get("_native_steps")  # not a parameter: kept out of the module's tree
    if kept is not None and len(kept.modules) == len(modules) and all(map(operator.is_, kept.modules, modules)):
        return kept
    steps = _block_steps(block, gemma, modules)
    if steps is None:
        block.__dict__.pop("_native_steps", None)
    else:
        block.__dict__["_native_steps"] = steps
    return steps


def _native_block(block: llama.TransformerBlock | gemma3_text.TransformerBlock, x: mx.array, cache,
                  gemma: bool) -> mx.array | None:
    """A decoder layer in six native operations plus the page writes, or None where that
    does not apply: norm and q/k/v products; heads; attention; output projection and
    residual (Gemma: its norm between); norm, gate/up products and activation; down
    projection and residual (Gemma: its norm between). Each fused step computes what the
    layer's own native operations do one by one, bit for bit, without the other eight
    operations' dispatch and graph building."""
    attn = block["self_attn"]
    # A batched decode step (kvexec.batch_cache): the B sequences' tokens go through the
    # products as the rows of one, each weight read once; heads, pages and attention
    # stay each sequence's own.
    members = cache.members if isinstance(cache, BatchLayerCache) and x.shape[1] == 1 else None
    if _heads_settings(attn, x, cache if members is None else members[0], None) is None:
        return None
    steps = _steps_for(block, gemma)
    if steps is None:
        return None
    w = [n["weight"] for n in steps.norms]
    rows = x if members is None else x.reshape(1, x.shape[0], x.shape[-1])
    q, k, v = steps.qkv(rows, norm=w[0])
    if members is None:
        attended = _attend(attn, q, k, v, cache, steps.heads())
    else:
        attended = mx.concatenate([_attend(attn, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], m, steps.heads())
                                   for i, m in enumerate(members)], axis=1)
    (h,) = steps.o(attended, residual=rows, **({"post_norm": w[1]} if gemma else {}))
    (gated,) = steps.gate_up(h, norm=w[2] if gemma else w[1])
    out = steps.down(gated, residual=h, **({"post_norm": w[3]} if gemma else {}))[0]
    return out if members is None else out.reshape(x.shape)


class NativeLlamaBlock(llama.TransformerBlock):
    """mlx-lm's llama decoder layer (same parameters) in fused native steps where they apply."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        out = _native_block(self, x, cache, gemma=False)
        return super().__call__(x, mask, cache) if out is None else out


class NativeGemmaBlock(gemma3_text.TransformerBlock):
    """mlx-lm's Gemma 3 decoder layer (same parameters) in fused native steps where they apply."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        out = _native_block(self, x, cache, gemma=True)
        return super().__call__(x, mask, cache) if out is None else out


_NATIVE_LAYERS = {llama.TransformerBlock: NativeLlamaBlock, gemma3_text.TransformerBlock: NativeGemmaBlock,
                  llama.Attention: NativeLlamaAttention, llama.MLP: NativeLlamaMLP, gemma3_text.MLP: NativeGemmaMLP,
                  gemma3_text.Attention: NativeGemmaAttention, gemma3_text.RMSNorm: NativeGemmaRMSNorm}


def install_native_layers(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """Give `model`'s llama and Gemma 3 attention layers, MLPs and Gemma's norms (exactly
    mlx-lm's classes) their native paths; each module changed, with its mlx-lm class
    (what justfit.model.adapter, which installs them, gives back when it removes them)."""
    changed = []
    for _, mod in model.named_modules():
        native = _NATIVE_LAYERS.get(type(mod))
        if native is not None:
            changed.append((mod, type(mod)))
            mod.__class__ = native
    return changed

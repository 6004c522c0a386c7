"""What a model's components will hold, from shapes alone: nothing is converted or read.
The planner and the engine size a form (and a prefill lease) before paying for one."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from phaseswap.forms import Q8T_GROUP, dense_bytes, is_linear
from phaseswap.native import eligible

# native: the stored weights where the native kernel computes them, q8t where it cannot;
# native-int16 / native-int8 the same, their products on activations rounded to 16 / 8 bits.
NATIVE_FORMS = {"native": 32, "native-int16": 16, "native-int8": 8}  # form -> activation bits

# Bytes per weight of a linear converted to each resident form (see forms.py).
_BYTES_PER_WEIGHT = {"q8t": 1 + 8 / Q8T_GROUP, "grouped": 1.5, "dense": 4.0,
                     **{form: 1 + 8 / Q8T_GROUP for form in NATIVE_FORMS}}


def predict_resident_bytes(model: nn.Module, form: str, dtype: mx.Dtype | None = None) -> int:
    """What `Registry.build(model, form, dtype)` will hold, from shapes alone (nothing
    is converted or read): lets a caller pick a form before paying for one."""
    def nbytes(a: mx.array) -> int:
        floating = dtype is not None and mx.issubdtype(a.dtype, mx.floating)
        return a.size * (dtype.size if floating else a.dtype.size)

    total = sum(nbytes(v) for _, v in tree_flatten(model.parameters()))
    if form == "stored":
        return total
    per_weight = _BYTES_PER_WEIGHT[form]
    body = model_body(model)
    linears = [m for _, m in model.named_modules() if is_linear(m)]
    embed = body.embed_tokens
    stored = {id(m): m for m in (*linears, embed) if form in NATIVE_FORMS and eligible(m)}
    for mod in stored.values():  # held as stored, scales and biases too
        total -= sum(nbytes(mod[k]) - mod[k].nbytes for k in ("scales", "biases"))
    for mod in (m for m in linears if id(m) not in stored):
        weights = dense_bytes(mod) // 4 - (mod["bias"].size if "bias" in mod else 0)
        total += int(weights * per_weight) - sum(nbytes(v) for k, v in tree_flatten(mod.parameters())
                                                 if k != "bias")
    if not isinstance(getattr(model, "lm_head", None), nn.Module) and split_head(form, embed):
        total += int(dense_bytes(embed) // 4 * per_weight)  # the tied head's own form
    if form == "dense":  # the embedding too
        total += dense_bytes(embed) - sum(nbytes(v) for _, v in tree_flatten(embed.parameters()))
    return total


def split_head(form: str, embed: nn.Module) -> bool:
    """Whether a tied output head gets its own decode form (q8t) apart from the lookup table."""
    return form in ("q8t", "grouped") or (form in NATIVE_FORMS and not eligible(embed))


def predict_working_bytes(model: nn.Module) -> int:
    """The largest dense working copy a prefill lease holds at once: one linear's
    (a lease dequantizes its layer's linears one at a time, forms.DenseWhileUsed)."""
    return max((dense_bytes(m) for layer in model_body(model).layers
                for _, m in layer.named_modules() if is_linear(m)), default=0)


def resident_prefill_bytes(linears) -> int:
    """What prefill on a layer's resident form holds besides it: its quantized products
    dequantize their weights, two side by side (gate and up): the two largest
    (Registry's `prefill_nbytes`), an upper bound on what the products hold."""
    return sum(sorted(dense_bytes(m) for m in linears if "scales" in m)[-2:])


def predict_prefill_bytes(model: nn.Module) -> int:
    """`resident_prefill_bytes` of the largest layer, from shapes alone."""
    return max((resident_prefill_bytes(m for _, m in layer.named_modules() if is_linear(m))
                for layer in model_body(model).layers), default=0)


def transformer_body(model: nn.Module) -> nn.Module | None:
    """The transformer under the output head (`model.model`, with `embed_tokens` and a
    list of `layers`), or None when the model is not shaped so."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None), list) \
            and isinstance(getattr(inner, "embed_tokens", None), nn.Module):
        return inner
    return None


def output_head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """What mlx-lm's models apply to their body's output for the logits: `lm_head`, or
    the tied embedding's `as_linear`; None where the model is not shaped so. Whether
    the model's own call applies anything more (a soft cap, a scale) is for the caller
    to check."""
    body = transformer_body(model)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        return head
    return getattr(body.embed_tokens, "as_linear", None) if body is not None else None


def model_body(model: nn.Module) -> nn.Module:
    """`transformer_body(model)`, or a clear error where the model is not shaped so."""
    body = transformer_body(model)
    if body is None:
        raise ValueError(f"{type(model).__name__}: PhaseSwap needs model.model.{{embed_tokens, layers}}")
    return body

"""Components of a model, their residency, and leases on them.

A component is the input embedding, one transformer layer, or the output head. It is
*resident* in its compact form, *materialized* while a lease holds a working copy in
another form (dense fp32 for prefill on CPU), or on *disk* when the budget cannot keep
it: its arrays are then unevaluated `mx.load` handles, read only while a lease is held
and dropped again at release.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from phaseswap.forms import (Q8T_GROUP, DenseWhileUsed, TiedEmbedding, dense_bytes, get_module, is_linear, module_bytes,
                             set_module, to_dense, to_grouped, to_q8t)

from phaseswap.native import eligible, is_native, join_siblings, to_native
from phaseswap.predict import NATIVE_FORMS, model_body, resident_prefill_bytes, split_head

RESIDENT_FORMS = ("q8t", "grouped", "stored", "dense", *NATIVE_FORMS)
CONVERT = {"q8t": to_q8t, "grouped": to_grouped, "dense": to_dense,
           **{form: lambda mod, bits=bits: to_native(mod, bits) or to_q8t(mod) for form, bits in NATIVE_FORMS.items()}}


class Residency(str, Enum):
    """Where a component's arrays are: on disk, resident, or materialized by a lease."""

    DISK = "disk"
    RESIDENT = "resident"
    MATERIALIZED = "materialized"


@dataclass
class Component:
    """One registered part of a model (the embedding, a layer or the head) and its residency."""

    name: str  # "embed", "layer.3", "head"
    kind: str  # "embed" | "layer" | "head"
    root: nn.Module  # the module whose `scope` children hold this component
    scope: str  # path under root of the component's module
    state: Residency = Residency.RESIDENT
    disk: Path | None = None  # its arrays in resident form, written on first offload
    nbytes: int = 0  # resident bytes
    dense_nbytes: int = 0  # bytes of its dense working copy, all its linears
    dense_held_nbytes: int = 0  # the most of it held at once: its largest linear (forms.DenseWhileUsed)
    prefill_nbytes: int = 0  # what prefill on its resident form holds (predict.resident_prefill_bytes)

    @property
    def module(self) -> nn.Module:
        """The component's module, looked up under its root."""
        return get_module(self.root, self.scope)

    def linears(self) -> list[str]:
        """Paths of the linear layers inside the component ("" when it is one itself)."""
        mod = self.module
        return [p for p, m in mod.named_modules() if is_linear(m) and p] or ([""] if is_linear(mod) else [])


@dataclass
class Counters:
    """Running totals of what leases moved: working copies made and dropped, and
    offloaded components read back from disk."""

    materialized_bytes: int = 0
    released_bytes: int = 0
    disk_read_bytes: int = 0
    disk_loads: int = 0

    def snapshot(self) -> "Counters":
        """A copy of the counters as they are now."""
        return Counters(**vars(self))

    def since(self, before: "Counters") -> "Counters":
        """What the counters moved since `before`."""
        return Counters(**{k: v - getattr(before, k) for k, v in vars(self).items()})


@dataclass
class Registry:
    """The components of one model and the memory they hold."""

    model: nn.Module
    resident_form: str
    offload_to: Path | None = None
    components: dict[str, Component] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    strict: bool = False  # return freed memory to the OS after every release (tight budgets)

    @classmethod
    def build(cls, model: nn.Module, resident_form: str = "stored", dtype: mx.Dtype | None = None,
              offload_to: Path | None = None, weight_limit: int | None = None) -> "Registry":
        """Register `model`'s components and convert each to `resident_form` (float
        parameters cast to `dtype` when given), one at a time so a lazily loaded model
        never holds two forms of more than one component. Past `weight_limit` resident
        bytes, each further layer goes to disk as soon as it is converted."""
        if resident_form not in RESIDENT_FORMS:
            raise ValueError(f"resident form must be one of {RESIDENT_FORMS}, not {resident_form!r}")
        reg = cls(model, resident_form, offload_to)
        body = model_body(model)
        comps = [Component("embed", "embed", body, "embed_tokens")]
        comps += [Component(f"layer.{i}", "layer", body, f"layers.{i}") for i, layer in enumerate(body.layers)
                  if tree_flatten(layer.parameters())]  # none: held elsewhere (a pipeline's stand-in)
        if isinstance(getattr(model, "lm_head", None), nn.Module):
            comps.append(Component("head", "head", model, "lm_head"))
        elif split_head(resident_form, body.embed_tokens) and body.embed_tokens.weight.shape[0] % Q8T_GROUP == 0:
            # tied: the head gets its own decode form (in _convert)
            body.embed_tokens = TiedEmbedding(body.embed_tokens, body.embed_tokens)
            comps[0].scope = "embed_tokens.lookup"
            comps.append(Component("head", "head", body, "embed_tokens.head"))
        for comp in comps:
            reg.components[comp.name] = comp
            reg._convert(comp, dtype)
            if weight_limit is not None and comp.kind == "layer" and reg.resident_bytes() > weight_limit:
                reg.offload(comp.name)
        return reg

    def _convert(self, comp: Component, dtype: mx.Dtype | None) -> None:
        form = self.resident_form
        if comp.kind == "head" and not is_linear(comp.module):  # a tied embedding
            self._swap(comp, "", CONVERT[form](_cast(comp.module, dtype)))
        elif form == "dense" and comp.kind == "embed":
            self._swap(comp, "", to_dense(comp.module))
        elif form in NATIVE_FORMS and comp.kind == "embed" and eligible(comp.module):
            self._swap(comp, "", to_native(comp.module, NATIVE_FORMS[form]))  # a tied head on the stored table
        elif form != "stored" and comp.kind != "embed":
            for path in comp.linears():
                self._swap(comp, path, CONVERT[form](get_module(comp.module, path)))
            if form in NATIVE_FORMS:
                join_siblings(comp.module)
        _cast(comp.module, dtype)
        mx.eval(comp.module.parameters())
        comp.nbytes = module_bytes(comp.module)
        linears = [get_module(comp.module, p) for p in comp.linears()]
        comp.dense_nbytes = sum(dense_bytes(m) for m in linears)
        comp.dense_held_nbytes = max((dense_bytes(m) for m in linears), default=0)
        if comp.kind == "layer":
            comp.prefill_nbytes = resident_prefill_bytes(linears)

    @staticmethod
    def _swap(comp: Component, path: str, module: nn.Module) -> None:
        if path:
            set_module(comp.module, path, module)
        else:
            set_module(comp.root, comp.scope, module)

    # -- accounting ------------------------------------------------------------------
    @property
    def layers(self) -> list[str]:
        """Names of the layer components, in model order."""
        return [n for n, c in self.components.items() if c.kind == "layer"]

    def resident_bytes(self) -> int:
        """Bytes held now by components not on disk (leased working copies excluded)."""
        return sum(c.nbytes for c in self.components.values() if c.state != Residency.DISK)

    def total_bytes(self) -> int:
        """Resident-form bytes of every component, on disk or not."""
        return sum(c.nbytes for c in self.components.values())

    def states(self) -> dict[str, str]:
        """Each component's residency, by name."""
        return {n: c.state.value for n, c in self.components.items()}

    # -- disk ------------------------------------------------------------------------
    def offload(self, name: str) -> None:
        """Keep `name` on disk: its arrays become lazy handles on its file."""
        comp = self.components[name]
        if comp.state == Residency.DISK:
            return
        if self.offload_to is None:
            raise ValueError("offloading a layer needs a folder to offload to")
        if comp.disk is None or not comp.disk.exists():
            self.offload_to.mkdir(parents=True, exist_ok=True)
            comp.disk = self.offload_to / f"{name}.safetensors"
            tmp = comp.disk.with_suffix(".tmp.safetensors")
            mx.save_safetensors(str(tmp), dict(tree_flatten(comp.module.parameters())))
            tmp.replace(comp.disk)
        self._point_at_disk(comp)
        comp.state = Residency.DISK
        mx.clear_cache()

    def restore(self, name: str) -> None:
        """Bring `name` back to stay resident."""
        comp = self.components[name]
        if comp.state != Residency.DISK:
            return
        mx.eval(comp.module.parameters())
        self.counters.disk_read_bytes += comp.nbytes
        self.counters.disk_loads += 1
        comp.state = Residency.RESIDENT

    def _point_at_disk(self, comp: Component) -> None:
        handles = mx.load(str(comp.disk))  # lazy: nothing is read until evaluated
        comp.module.update(tree_unflatten(list(handles.items())), strict=False)

    # -- leases ----------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, name: str, form: str = "resident") -> Iterator[nn.Module]:
        """Hold `name` usable in `form` ("resident" or "dense") for the block. The
        caller evaluates what it computes before the block ends: release drops the
        working copy (and a offloaded component's arrays) at once."""
        comp = self.components[name]
        offloaded = comp.state == Residency.DISK
        stash: list[tuple[str, nn.Module]] = []
        if form == "dense":
            for path in comp.linears():
                mod = get_module(comp.module, path)
                stash.append((path, mod))
                self._swap(comp, path, DenseWhileUsed(mod))
            comp.state = Residency.MATERIALIZED
            self.counters.materialized_bytes += comp.dense_nbytes
        elif form != "resident":
            raise ValueError(f"lease form must be resident or dense, not {form!r}")
        try:
            yield comp.module
        finally:
            for path, mod in stash:
                self._swap(comp, path, mod)
            if stash:
                self.counters.released_bytes += comp.dense_nbytes
            if offloaded:
                self.counters.disk_read_bytes += comp.nbytes
                self.counters.disk_loads += 1
                self._point_at_disk(comp)
                comp.state = Residency.DISK
            else:
                comp.state = Residency.RESIDENT
            if self.strict and (stash or offloaded):
                mx.clear_cache()


def _cast(module: nn.Module, dtype: mx.Dtype | None) -> nn.Module:
    """Floating parameters to `dtype`, but a native module's scales and biases stay as
    stored (the kernel reads them so)."""
    if dtype is not None:
        keep = lambda m, k, v: nn.Module.valid_parameter_filter(m, k, v) and not (  # noqa: E731
            is_native(m) and k in ("scales", "biases"))
        module.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, keep)
    return module

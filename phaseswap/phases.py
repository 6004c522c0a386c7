"""Phases: prefill and decode run with the leases their policy asks for, and each
reports its time, peak memory and the bytes it materialized, released and read."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from phaseswap.policy import ResidencyPolicy, get_policy
from phaseswap.registry import Counters, Registry, Residency


@dataclass
class PhaseStats(Counters):
    """What one phase cost: the registry's counters over the phase, and more."""

    name: str = ""
    seconds: float = 0.0
    peak_bytes: int = 0  # MLX peak memory during the phase
    resident_components: int = 0
    offloaded_components: int = 0

    def as_dict(self) -> dict:
        """The stats as a plain dict."""
        return asdict(self)

    def summary(self) -> str:
        """One readable line: time, peak memory, residency, and what was materialized and read."""
        mib = 2**20
        text = (f"{self.name}: {self.seconds:.2f} s, MLX peak {self.peak_bytes / mib:.0f} MiB, "
                f"{self.resident_components} components resident, {self.offloaded_components} on disk")
        if self.materialized_bytes:
            text += (f", materialized {self.materialized_bytes / mib:.0f} MiB "
                     f"(released {self.released_bytes / mib:.0f})")
        if self.disk_loads:
            text += f", read {self.disk_read_bytes / mib:.0f} MiB in {self.disk_loads} loads"
        return text


def _hooked_class(cls: type) -> type:
    """A new subclass of `cls` whose calls go through the owning PhaseSwap (the class
    is swapped on the instance, so parameter paths and everything else stay the
    model's own). Each PhaseSwap makes one per model class and keeps it."""
    def __call__(self, *args, **kwargs):
        swap, name = self.__dict__["_phaseswap"]
        return swap._call(name, self, cls.__call__, args, kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "phaseswap_base": cls})


class PhaseSwap:
    """A model's components under one policy, run phase by phase."""

    # Below this many tokens a layer runs on its resident form even where the phase
    # asks for dense: dequantizing a layer costs about as much as a few rows of q8t
    # matvec, e.g. prefill's last token.
    dense_min_tokens = 8

    def __init__(self, model: nn.Module, policy: ResidencyPolicy | str | None = None,
                 offload_to: Path | None = None, weight_limit: int | None = None,
                 probe_tokens: int = 256):
        self.policy = policy if isinstance(policy, ResidencyPolicy) else get_policy(policy)
        self.registry = Registry.build(model, self.policy.resident, mx.float32 if self.policy.fp32 else None,
                                       offload_to, weight_limit=weight_limit)
        layers = self.registry.layers
        if self.policy.prefill == "measured":
            self.prefill_forms = measure_prefill_forms(self.registry, probe_tokens)
        else:
            form = "dense" if self.policy.prefill == "dense" else "resident"
            self.prefill_forms = {name: form for name in layers}
        self._forms: dict[str, str] = {}
        self._hooked_classes: dict[type, type] = {}  # model class -> its hooked subclass, this swap's own
        for name, comp in self.registry.components.items():
            if comp.kind != "embed":
                self._hook(comp.module, name)

    def _hook(self, module: nn.Module, name: str) -> None:
        """Route `module`'s calls through this PhaseSwap (a module an earlier one hooked
        is taken back to its model class first)."""
        base = getattr(type(module), "phaseswap_base", type(module))
        if base not in self._hooked_classes:
            self._hooked_classes[base] = _hooked_class(base)
        module.__class__ = self._hooked_classes[base]
        object.__setattr__(module, "_phaseswap", (self, name))

    # -- running ---------------------------------------------------------------------
    def _call(self, name: str, module: nn.Module, base_call: Callable, args: tuple, kwargs: dict):
        form = self._forms.get(name, "resident")
        if form == "dense" and args and getattr(args[0], "ndim", 0) == 3 and args[0].shape[1] < self.dense_min_tokens:
            form = "resident"
        if form == "resident" and self.registry.components[name].state != Residency.DISK:
            return base_call(module, *args, **kwargs)
        with self.registry.lease(name, form) as leased:
            out = base_call(module, *args, **kwargs) if leased is module else leased(*args, **kwargs)
            # Evaluate now: the lease ends below and its arrays must not be needed later.
            cache = kwargs.get("cache", args[2] if len(args) > 2 else None)
            state = [v for _, v in tree_flatten(getattr(cache, "state", None) or [])
                     if isinstance(v, mx.array)]
            mx.eval(out, state)
        return out

    @contextlib.contextmanager
    def phase(self, name: str, dense: bool = True) -> Iterator[PhaseStats]:
        """Run the block as phase `name` ("prefill" or "decode"); `dense` False: prefill
        on the resident forms too (no dense working copy: what a tight budget's plan asks)."""
        self._forms = dict(self.prefill_forms) if name == "prefill" and dense else {}
        stats = PhaseStats(name=name)
        before = self.registry.counters.snapshot()
        mx.reset_peak_memory()
        start = time.perf_counter()
        try:
            yield stats
        finally:
            self._forms = {}
            delta = self.registry.counters.since(before)
            states = self.registry.states().values()
            stats.seconds = time.perf_counter() - start
            stats.peak_bytes = mx.get_peak_memory()
            for f in fields(Counters):
                setattr(stats, f.name, getattr(delta, f.name))
            stats.offloaded_components = sum(s == Residency.DISK.value for s in states)
            stats.resident_components = len(states) - stats.offloaded_components

    # -- memory ----------------------------------------------------------------------
    def offload(self, names: tuple[str, ...] | list[str]) -> None:
        """Keep exactly `names` on disk; everything else resident."""
        for name, comp in self.registry.components.items():
            if name in names:
                self.registry.offload(name)
            elif comp.state == Residency.DISK:
                self.registry.restore(name)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The components on disk now."""
        return tuple(n for n, c in self.registry.components.items() if c.state == Residency.DISK)

    def offload_order(self) -> list[str]:
        """Which components go to disk first when the budget is short: the last
        layers, then the head. The embedding stays (a lookup reads a few rows)."""
        return self.registry.layers[::-1] + (["head"] if "head" in self.registry.components else [])

    def working_bytes(self, offloaded: tuple[str, ...] | list[str] = (), dense: bool = True) -> int:
        """Largest transient a lease adds: a dense working copy, one linear at a time (unless
        prefill runs on the resident forms, `dense` False: then what their products
        dequantize), an offloaded component."""
        worst = 0
        for name, comp in self.registry.components.items():
            dense_copy = (comp.dense_held_nbytes if dense and self.prefill_forms.get(name) == "dense"
                          else comp.prefill_nbytes)
            worst = max(worst, dense_copy + (comp.nbytes if name in offloaded else 0))
        return worst


def measure_prefill_forms(registry: Registry, tokens: int) -> dict[str, str]:
    """Time each distinct layer shape on a probe chunk, resident vs dense; keep the faster."""
    forms: dict[str, str] = {}
    timed: dict[tuple, str] = {}
    for name in registry.layers:
        comp = registry.components[name]
        key = tuple((k, v.shape, v.dtype) for k, v in tree_flatten(comp.module.parameters()))
        if key not in timed:
            hidden = _hidden_size(comp.module)
            # its own key: MLX's global one would keep a lazy graph of every draw
            x = mx.random.normal((1, tokens, hidden), key=mx.random.key(0))
            x = x.astype(mx.float32 if registry.resident_form != "stored" else mx.float16)
            cost = {}
            for form in ("resident", "dense"):
                with registry.lease(name, form) as mod:
                    mx.eval(mod(x, None, None))  # warm
                    start = time.perf_counter()
                    mx.eval(mod(x, None, None))
                    cost[form] = time.perf_counter() - start
            timed[key] = min(cost, key=cost.get)
        forms[name] = timed[key]
    return forms


def _hidden_size(layer: nn.Module) -> int:
    for _, mod in layer.named_modules():
        if isinstance(mod, nn.RMSNorm) or isinstance(mod, nn.LayerNorm):
            return mod.weight.shape[0]
    raise ValueError("cannot tell the layer's hidden size")

"""The model adapter: the one entry point for everything JustFit changes in how
mlx-lm's model code runs. Reading mlx-lm's llama.py tells you what runs, plus what
`install` puts in, always in this order:

1. The attention seam (kvexec/seam.py), for a paged KV cache: the attention function
   of each mlx-lm module the model comes from is wrapped, so a paged cache's calls run
   KVExec's executor (others go to mlx-lm unchanged); then its probe (`check`).
2. Native operations (phaseswap.native.install_ops): plain nn.RoPE and nn.RMSNorm
   instances replaced by native subclasses holding the same arrays.
3. Native layers (justfit/model/native_layers.py): llama and Gemma 3 decoder layers,
   attention, MLPs and Gemma's norms get native subclasses (class swapped in place).
4. Phase hooks (phaseswap/phases.py): PhaseSwap converts each component's weights to
   the policy's resident form and hooks its class, so each call runs under its lease.

Why this order: the probe runs first, on the model as loaded, so a refused model
has nothing else to undo, and before the hooks (through them its forward would read
offloaded weights); the native layers fall back to mlx-lm's attention, which must
already reach the seam. Native operations precede native layers: a native attention
layer takes its fused path only where its rope is a NativeRoPE. The layers' classes
precede the hooks: PhaseSwap hooks a subclass of each component's class as it is
then, and a class swapped afterwards would drop the hook (and would not match
mlx-lm's class, which is what the native layers replace).

`remove` undoes them in reverse: hooks, layer classes, replaced instances, and the
seam (a module's function goes back once no adapted model uses it, where the adapter
wrapped it). The weights stay in the forms PhaseSwap converted them to: data, not code.

The mechanisms stay in their modules; the engine and the loader install through here.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import mlx.nn as nn

from justfit import runtime
from justfit.model.native_layers import install_native_layers
from kvexec import seam
from phaseswap import PhaseSwap
from phaseswap.native import replace_ops
from phaseswap.policy import ResidencyPolicy

_lock = threading.Lock()  # the seam's globals are shared by every model of a type
_seam_users: collections.Counter = collections.Counter()  # module -> adapted models routing through it
_seam_ours: set[ModuleType] = set()  # modules whose attention function the adapter wrapped


@dataclass
class Adapted:
    """What `install` changed in one model, for `remove`."""

    model: nn.Module
    seam: list[ModuleType] = field(default_factory=list)  # modules whose attention reaches KVExec
    ops: list[tuple] = field(default_factory=list)  # (container, key, original, native) instances
    layers: list[tuple[nn.Module, type]] = field(default_factory=list)  # (module, mlx-lm's class)
    swap: PhaseSwap | None = None
    removed: bool = False


def install(model: nn.Module, *, paged: bool, native: bool, policy: ResidencyPolicy | str | None = None,
            offload_to: Path | None = None, weight_limit: int | None = None, probe: bool = True) -> Adapted:
    """Adapt `model` in the order the module docstring gives: the attention seam (with
    `paged`: a paged KV cache serves it), native operations and layers (with `native`,
    where the kernels are on), PhaseSwap under `policy` (with the offload folder and
    resident weight limit). `probe` False skips the seam's probe: for a model already
    checked whole and then split across pipeline ranks, where a forward crosses ranks.
    Raise SeamBypassed, with nothing installed, for a model the seam cannot serve."""
    adapted = Adapted(model)
    if paged:
        with _lock:
            modules = seam.wrap(model)
            try:
                if probe:
                    seam.check(model)
            except BaseException:
                for mod, ours in modules:
                    if ours:
                        seam.unwrap(mod)
                raise
            for mod, ours in modules:
                _seam_users[mod] += 1
                if ours:
                    _seam_ours.add(mod)
            adapted.seam = [mod for mod, _ in modules]
    if native and runtime.native_kernels() is not None:
        adapted.ops = replace_ops(model)
        adapted.layers = install_native_layers(model)
    if policy is not None:
        adapted.swap = PhaseSwap(model, policy, offload_to, weight_limit)
    return adapted


def check(model: nn.Module) -> int:
    """Refuse, with SeamBypassed, a model whose attention layers would not each reach
    KVExec's executor (the seam's probe: graphs built, no weight read); the layers
    checked. Works on a model not adapted yet: what it wraps for the probe it unwraps."""
    with _lock:
        modules = seam.wrap(model)
        try:
            return seam.check(model)
        finally:
            for mod, ours in modules:
                if ours:
                    seam.unwrap(mod)


def remove(adapted: Adapted) -> None:
    """Undo `install`, in reverse order: the model's modules run as mlx-lm loaded them
    (the weights in the forms PhaseSwap made). Idempotent."""
    if adapted.removed:
        return
    adapted.removed = True
    if adapted.swap is not None:
        _unhook(adapted.model, adapted.swap)
    for mod, original in reversed(adapted.layers):
        if issubclass(type(mod), original):
            mod.__class__ = original
        mod.__dict__.pop("_native_steps", None)  # the fused steps the native layer kept
    for container, key, original, installed in reversed(adapted.ops):
        if container[key] is installed:
            dict.update(original, dict(installed))  # the members as they are now (e.g. cast)
            container[key] = original
    with _lock:
        for mod in adapted.seam:
            _seam_users[mod] -= 1
            if _seam_users[mod] <= 0:
                del _seam_users[mod]
                if mod in _seam_ours:
                    _seam_ours.discard(mod)
                    seam.unwrap(mod)


def _unhook(model: nn.Module, swap: PhaseSwap) -> None:
    """Take the components `swap` hooked back to their model classes."""
    components = [c.module for c in swap.registry.components.values()]
    for mod in [m for _, m in model.named_modules()] + components:
        hook = mod.__dict__.get("_phaseswap")
        if hook is not None and hook[0] is swap:
            mod.__class__ = type(mod).phaseswap_base
            del mod.__dict__["_phaseswap"]

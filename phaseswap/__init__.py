"""PhaseSwap: per-phase weight residency, just-in-time materialization, layers offloaded to disk.

`PhaseSwap` (phases.py) is the public face: built from a model and a named policy, it
converts every component to its resident form, runs prefill and decode phases with
the leases each needs, moves layers to disk when the budget asks, and reports what
each phase cost.
"""

from phaseswap.forms import GroupedQuantizedLinear, TransposedQuantizedLinear, materialize_dense
from phaseswap.phases import PhaseStats, PhaseSwap
from phaseswap.policy import POLICIES, ResidencyPolicy, default_policy
from phaseswap.registry import Component, Registry, Residency

__all__ = ["POLICIES", "Component", "PhaseStats", "PhaseSwap", "Registry", "Residency", "ResidencyPolicy",
           "GroupedQuantizedLinear", "TransposedQuantizedLinear", "default_policy", "materialize_dense"]

"""PhaseSwap: per-phase weight residency and just-in-time materialization.

Today: whole-model dense materialization for the CPU backend (`materialize_dense`).
Per-layer leases, phase plans and layer streaming are the PhaseSwap issue's work.
"""

from phaseswap.materialize import dense_bytes, materialize_dense

__all__ = ["dense_bytes", "materialize_dense"]

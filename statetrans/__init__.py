"""StateTrans: serving state saved, restored and moved, byte-exact.

`capture` / `rebuild` turn a per-layer cache list into arrays + metadata and back;
`save_snapshot` / `load_snapshot` put them on disk atomically with checksums;
`StateTiers` keeps states in memory and on disk, found by token prefix, and writes
named sessions through to disk at every turn; `park` / `unpark` set a running
sequence's state aside on disk and take it back (preemption).
"""

from statetrans.index import Reuse
from statetrans.parking import Parked, keep_parked, park, unpark
from statetrans.publish import save_snapshot
from statetrans.snapshot import SnapshotError, load_snapshot, snapshot_bytes
from statetrans.state import capture, holds, rebuild, state_bytes
from statetrans.tiers import StateTiers

__all__ = ["Parked", "Reuse", "keep_parked", "park", "unpark", "SnapshotError", "StateTiers", "capture", "holds", "load_snapshot", "rebuild", "save_snapshot",
           "snapshot_bytes", "state_bytes"]

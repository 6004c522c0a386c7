"""StateTrans: serving state saved, restored and moved, byte-exact.

`capture` / `rebuild` turn a per-layer cache list into arrays + metadata and back;
`save_snapshot` / `load_snapshot` put them on disk atomically with checksums.
"""

from statetrans.snapshot import SnapshotError, load_snapshot, save_snapshot, snapshot_bytes
from statetrans.state import capture, rebuild, state_bytes

__all__ = ["SnapshotError", "capture", "load_snapshot", "rebuild", "save_snapshot", "snapshot_bytes",
           "state_bytes"]

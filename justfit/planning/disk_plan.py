"""`justfit fit --kv-disk`: what a context costs with every growing layer's KV pages on
disk, from the planner's own footprint (justfit.planning.cost_model: what stays resident
with pages on disk is the weights, the recurrent states, each disk layer's segment being
filled and the reader's two slots), the disk it takes and the bandwidth it reads at.

Decode reads every disk layer's pages once a token (kvexec.disk_pages), so bytes read a
token are the pages on disk, and bandwidth / those bytes is an I/O bound on the decode
rate: a prediction, not a measurement (compute and the reader's copies come on top).
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, replace

from justfit.planning.cost_model import Footprint

# Decimal and binary units of a bandwidth; a bare number is bytes a second.
_BANDWIDTH_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BANDWIDTH = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/\s*s)?\s*")
# The probe: long enough to be past a drive's burst, short enough for a command (~0.1 s at 1-2 GB/s).
PROBE_BYTES = 128 << 20
_BLOCK = 4 << 20


def parse_bandwidth(text: str | float) -> float:
    """'6GB/s', '500 MB/s', '2GiB/s', '6e9' -> bytes a second (above zero)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _BANDWIDTH.fullmatch(text)
        if not m or m.group(2).lower() not in _BANDWIDTH_UNITS:
            raise ValueError(f"not a bandwidth: {text!r} (try 6GB/s, 500MB/s, 2GiB/s or bytes a second)")
        value = float(m.group(1)) * _BANDWIDTH_UNITS[m.group(2).lower()]
    if not value > 0:
        raise ValueError(f"a bandwidth is above zero: {text!r}")
    return value


def writable_folder(folder: str) -> str:
    """`folder`, made if missing and checked by writing a file there; ValueError if it
    cannot hold pages."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(dir=folder, prefix=".justfit-probe-")
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        raise ValueError(f"cannot write KV pages to {folder}: {e.strerror or e}") from None
    return folder


@dataclass(frozen=True)
class Bandwidth:
    """A sequential read rate and where it comes from."""

    bytes_per_s: float
    method: str  # "given", or how the probe kept the page cache out of it

    def as_dict(self) -> dict:
        """The figures by name, for JSON."""
        return {"bytes_per_s": round(self.bytes_per_s), "method": self.method}


def measure_bandwidth(folder: str, nbytes: int = PROBE_BYTES) -> Bandwidth:
    """Read a temporary file of `nbytes` in `folder` once, sequentially, past the page
    cache: O_DIRECT where the system and file system take it, else the file's cached
    pages dropped (F_NOCACHE on macOS, as the page file itself reads; posix_fadvise
    elsewhere) before reading; the method says which. The file is removed."""
    os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".justfit-bandwidth-")
    try:
        block = os.urandom(1 << 20) * (_BLOCK >> 20)  # random: no file system compresses it away
        if sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        written = 0
        while written < nbytes:
            written += os.write(fd, block[:min(_BLOCK, nbytes - written)])
        os.fsync(fd)
        method = "page cache bypassed (F_NOCACHE)" if sys.platform == "darwin" else "page cache dropped (fadvise)"
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif sys.platform != "darwin":
            method = "page cache not bypassed: an upper bound"
        os.close(fd)
        fd = -1
        read_fd = None
        if hasattr(os, "O_DIRECT"):
            try:
                read_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                method = "O_DIRECT"
            except OSError:  # tmpfs and some others refuse it
                read_fd = None
        if read_fd is None:
            read_fd = os.open(path, os.O_RDONLY)
            if sys.platform == "darwin":
                import fcntl

                fcntl.fcntl(read_fd, fcntl.F_NOCACHE, 1)
        buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
        try:
            done, start = 0, time.perf_counter()
            while done < nbytes:
                n = os.readv(read_fd, [buf])
                if n <= 0:
                    break
                done += n
            seconds = time.perf_counter() - start
        except OSError:  # O_DIRECT opened but refused the read: once more, through the cache's drop
            os.close(read_fd)
            return _buffered(path, nbytes)
        finally:
            buf.close()
        os.close(read_fd)
        return Bandwidth(done / max(seconds, 1e-9), method)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def _buffered(path: str, nbytes: int) -> Bandwidth:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start, done = time.perf_counter(), 0
        while done < nbytes:
            chunk = os.read(fd, _BLOCK)
            if not chunk:
                break
            done += len(chunk)
        return Bandwidth(done / max(time.perf_counter() - start, 1e-9), "page cache dropped (fadvise)")
    finally:
        os.close(fd)


def bandwidth_for(folder: str, given: str | float | None) -> Bandwidth:
    """The bandwidth given (parsed), else measured on `folder`."""
    if given is not None:
        return Bandwidth(parse_bandwidth(given), "given")
    return measure_bandwidth(folder)


def _limited(fp: Footprint) -> Footprint:
    """`fp` with its pages held to a budget's limit (as `Footprint.max_positions` sizes)."""
    return replace(fp, shape=replace(fp.shape, limited=True))


def disk_figures(fp: Footprint, bandwidth: float | None) -> dict:
    """What `fp` (a footprint with layers on disk) keeps resident, has on disk and reads a
    decoded token, and the decode rate that read bounds at `bandwidth` bytes a second."""
    s = fp.shape
    read = fp.disk  # every disk layer's pages, once a token
    return {"positions": fp.positions, "disk_layers": s.disk_layers, "resident_total": fp.total,
            "weights": fp.weights, "states": s.state_bytes, "read_slots": fp.read_slots,
            "kv_resident": fp.kv - s.state_bytes - fp.read_slots, "transient": fp.transient,
            "reserve": fp.reserve, "bytes_on_disk": fp.disk, "read_per_token": read,
            "segments_on_disk": fp.disk_segments,
            "predicted_tok_s": None if not read or not bandwidth else bandwidth / read,
            "io_s_per_token": None if not read or not bandwidth else read / bandwidth}


def positions_on(probe: Footprint, room: int) -> int:
    """The most positions whose pages on disk (with `probe`'s layers there) fit `room` bytes."""
    shape = _limited(probe)
    lo, hi = 0, 1
    while shape.at(hi).disk <= room and hi < 1 << 32:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if shape.at(mid).disk <= room else (lo, mid)
    return lo


def disk_report(probe: Footprint, budget: int, folder: str, bandwidth: Bandwidth, bits: float,
                label: str, context: Footprint | None = None, limit: int | None = None,
                others: list[tuple[str, float, Footprint]] = ()) -> dict:
    """The `--kv-disk` report: `probe` is the footprint at one position with every
    growing layer's pages on disk (pages in `label`, `bits` a value); the most positions
    `budget` holds so, and what they cost on disk and a token; the plan `context` (a
    footprint, if asked); the disk's free space at `folder` (`limit`: the engine's
    --kv-disk-limit); `others`: (label, bits, probe) of other page formats."""
    from justfit.planning.plan import kv_disk_room

    n = probe.max_positions(budget)
    usage = shutil.disk_usage(folder)
    room = kv_disk_room(folder, limit)
    report = {"folder": folder, "bandwidth": bandwidth.as_dict(), "format": label, "bits_per_value": bits,
              "budget": budget, "max_positions": n, "at_max": disk_figures(_limited(probe).at(n), bandwidth.bytes_per_s),
              "disk_free": usage.free, "disk_room": room, "disk_room_positions": positions_on(probe, room),
              "others": []}
    length = n if context is None else context.positions  # the others' reads at the same length
    for name, b, fp in others:
        at = disk_figures(_limited(fp).at(length), bandwidth.bytes_per_s)
        report["others"].append({"format": name, "bits_per_value": b, "max_positions": fp.max_positions(budget),
                                 "positions": length, "read_per_token": at["read_per_token"],
                                 "predicted_tok_s": at["predicted_tok_s"]})
    if context is not None:
        every = _limited(probe).at(context.positions)
        report["plan"] = {**disk_figures(context, bandwidth.bytes_per_s), "fits": context.total <= budget,
                          "disk_fits": context.disk <= room,
                          "every_layer": disk_figures(every, bandwidth.bytes_per_s)}
    return report


# Top-1 of the formats the rows show, measured on SmolLM2 over 4,096 tokens
# (docs/BENCHMARKS.md: "The default pages" against float16 KV, "KVExec page formats:
# fidelity" against float32 KV).
FIDELITY_SOURCE = ("SmolLM2 over 4,096 tokens, docs/BENCHMARKS.md: the default pages against float16 KV, "
                   "the others against float32 KV")
MEASURED_TOP1 = {"default pages": 99.27, "q8c": 99.90, "k8cv4": 99.02, "q4c": 97.90, "q3c": 93.63, "q2c": 82.83}


def format_disk(r: dict) -> list[str]:
    """The report's lines for the terminal."""
    from justfit.memory import format_size

    bw, at = r["bandwidth"], r["at_max"]
    rate = f"{bw['bytes_per_s'] / 1e9:.2f} GB/s ({'given' if bw['method'] == 'given' else 'measured on the folder: ' + bw['method']})"
    lines = [f"KV pages on disk in {r['folder']} (every growing layer's; read back each token, exact), "
             f"pages: {r['format']} ({r['bits_per_value']:.2f} bits a value), read at {rate}:",
             f"  the budget {format_size(r['budget'])} holds {r['max_positions']:,} positions: resident "
             f"{format_size(at['resident_total'])} = weights {format_size(at['weights'])} + recurrent states "
             f"{format_size(at['states'])} + reader slots {format_size(at['read_slots'])} + other KV "
             f"{format_size(at['kv_resident'])} (sinks, hot windows, segments being filled) + transient "
             f"{format_size(at['transient'])} + reserve {format_size(at['reserve'])}; page index "
             f"{at['segments_on_disk']:,} segments",
             *_cost_lines(at, "  at that length"),
             f"  disk: {format_size(at['bytes_on_disk'])} needed; {format_size(r['disk_free'])} free in the folder, "
             f"of which the engine takes {format_size(r['disk_room'])} (half the free space, a tenth of the disk "
             f"kept, or --kv-disk-limit): {r['disk_room_positions']:,} positions"]
    plan = r.get("plan")
    if plan:
        verdict = "fits" if plan["fits"] and plan["disk_fits"] else \
            "does NOT fit the budget" if not plan["fits"] else "does NOT fit the disk room"
        lines += [f"  plan for {plan['positions']:,} positions with pages on disk: {verdict} "
                  f"({format_size(plan['resident_total'])} resident of {format_size(r['budget'])}, "
                  f"{format_size(plan['bytes_on_disk'])} on disk, {plan['disk_layers']} of "
                  f"{r['at_max']['disk_layers']} layers' pages there{_fewer(plan, r)})",
                  *_cost_lines(plan, "  so")]
        if plan["disk_layers"] != r["at_max"]["disk_layers"]:
            lines += _cost_lines(plan["every_layer"], "  with every layer's pages on disk instead")
    if r["others"]:
        lines.append(f"  every page in one format instead (most positions the budget holds; read a token and "
                     f"predicted decode at {r['others'][0]['positions']:,} positions; top-1 measured on "
                     f"{FIDELITY_SOURCE}):")
        for o in r["others"]:
            top1 = MEASURED_TOP1.get(o["format"])
            rate = f"{o['predicted_tok_s']:.2f} tok/s" if o["predicted_tok_s"] else "-"
            lines.append(f"    {o['format']:<13} {o['bits_per_value']:>5.2f} bits  {o['max_positions']:>12,} positions  "
                         f"{format_size(o['read_per_token']):>11} a token  {rate:>11}  "
                         f"{'top-1 ' + format(top1, '.2f') + '%' if top1 else 'fidelity not measured'}")
    return lines


def _fewer(plan: dict, r: dict) -> str:
    return "" if plan["disk_layers"] == r["at_max"]["disk_layers"] else ": the planner moves only what the budget needs"


def _cost_lines(f: dict, head: str) -> list[str]:
    from justfit.memory import format_size

    if not f["read_per_token"]:
        return [f"{head}: nothing on disk yet"]
    return [f"{head}: {format_size(f['bytes_on_disk'])} on disk, {format_size(f['read_per_token'])} read a "
            f"decoded token: {f['io_s_per_token']:.2f} s of reads a token, predicted decode at most "
            f"{f['predicted_tok_s']:.2f} tok/s (an I/O bound, not a measurement: compute comes on top)"]


def engine_disk_report(engine, budget: int, bandwidth: Bandwidth, context: int | None = None) -> dict:
    """`justfit fit --kv-disk` for a loaded model: every growing layer's pages in the
    engine's KV folder, in its KV format; the plan for `context` as the engine's planner
    makes it (layers go to disk only as the budget needs)."""
    from justfit.planning.fit import kv_label
    from justfit.planning.fit_config import bits_per_value

    base, planner = engine.config.kv, engine.planner
    if base is None or engine.config.kv_disk is None:
        raise ValueError("pages on disk need KVExec pages and a KV folder (not --kv-format none)")
    layers = planner.edge_footprint().shape.full_layers
    if not layers:
        raise ValueError("this model has no full-attention layer: no page grows with the context, none goes to disk")
    _, kv_heads, head_dim = engine.kv_shape
    others = []
    for name in ("q8c", "k8cv4", "q4c", "q3c"):
        kv = replace(base, format=name, layer_formats=())
        from kvexec import get_format

        if get_format(name).supports_head_dim(head_dim):
            others.append((name, bits_per_value(kv, kv_heads, head_dim), planner.edge_footprint(kv=kv, disk_layers=layers)))
    plan = None
    if context is not None:
        with engine.budget.trial(budget):  # planned under the budget asked about
            _, plan = planner.plan(context)
    return disk_report(planner.edge_footprint(disk_layers=layers), budget, engine.config.kv_disk, bandwidth,
                       bits_per_value(base, kv_heads, head_dim), kv_label(base), plan,
                       engine.config.kv_disk_limit, others)


class LazyBandwidth:
    """A folder's read rate, measured once in a thread on first asked for (a server's
    status must not wait for it): None until measured."""

    def __init__(self, folder: str, given: str | float | None = None):
        import threading

        self.folder = folder
        self.value: Bandwidth | None = Bandwidth(parse_bandwidth(given), "given") if given is not None else None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._thread = None

    def get(self) -> Bandwidth | None:
        """The rate if measured; starts measuring on the first call."""
        import threading

        with self._lock:
            if self.value is None and self._thread is None and self.error is None:
                self._thread = threading.Thread(target=self._measure, name="kv-disk-bandwidth", daemon=True)
                self._thread.start()
        return self.value

    def wait(self, timeout: float | None = None) -> Bandwidth | None:
        """The rate, waiting up to `timeout` seconds for a measurement in flight (tests, CLIs)."""
        self.get()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.value

    def _measure(self) -> None:
        try:
            self.value = measure_bandwidth(self.folder)
        except OSError as e:
            self.error = str(e)


_STATUS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> (budget key, probe, most positions)


def status_figures(engine, bandwidth: LazyBandwidth | None, bytes_last: int) -> dict:
    """What pages on disk cost the running engine, for /v1/justfit/status: positions on
    disk after the last request, bytes on disk and read a token per position, and at the
    trained context and at the most positions the budget holds with every growing
    layer's pages on disk, with the I/O-bound decode rate at the folder's bandwidth
    (measured lazily: None until then)."""
    if engine.config.kv is None or engine.config.kv_disk is None:
        return {}
    budget = engine.budget.bytes
    # Planned again only when the budget or its measured reserve changes (the event loop asks).
    key = (budget, engine.budget.reserve)
    held = _STATUS.get(engine)
    if held is None or held[0] != key:
        probe = engine.planner.edge_footprint(disk_layers=engine.planner.edge_footprint().shape.full_layers)
        held = _STATUS[engine] = (key, probe, probe.max_positions(budget) if budget is not None else None)
    _, probe, most = held
    s = probe.shape
    if not s.disk_layers:
        return {}
    per_position = s.page_row * s.disk_layers  # bytes on disk, and read a token, per position on disk
    bw = bandwidth.get() if bandwidth is not None else None
    rate = bw.bytes_per_s if bw is not None else None

    def at(positions: int) -> dict:
        f = disk_figures(_limited(probe).at(positions), rate)
        return {k: f[k] for k in ("positions", "bytes_on_disk", "read_per_token", "resident_total",
                                  "predicted_tok_s")}

    return {"bandwidth": bw.as_dict() if bw is not None else None,
            "bandwidth_error": bandwidth.error if bandwidth is not None else None,
            "positions_on_disk_last": int(bytes_last / per_position) if per_position else 0,
            "bytes_per_position": round(per_position),
            "at_context_limit": at(engine.context_limit),
            "at_max": at(most) if most is not None else None,
            "note": "predicted_tok_s: the read's I/O bound on decode, bandwidth / bytes read a token "
                    "(a prediction; compute comes on top)"}

"""`justfit fit --kv-disk`: what a context costs with every growing layer's KV pages on
disk, from the planner's own footprint (justfit.planning.cost_model: what stays resident
with pages on disk is the weights, the recurrent states, each disk layer's segment being
filled and the reader's two slots), the disk it takes and the bandwidth it reads at.

Decode reads every disk layer's pages once a token (kvexec.disk_pages), so bytes read a
token are the pages on disk, and bandwidth / those bytes is an I/O bound on the decode
rate: a prediction, not a measurement (compute and the reader's copies come on top).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

from justfit.planning.cost_model import Footprint
from justfit.planning.disk_bandwidth import Bandwidth, LazyBandwidth
from kvexec import KVConfig, get_format, page_bytes_per_token

# The formats the report compares with the one in use: the widest, then the pressure ladder's steps.
OTHER_FORMATS = ("q8c", "k8cv4", "q4c", "q3c")


def bits_per_value(kv: KVConfig, kv_heads: int, head_dim: int) -> float:
    """Page bits a K or V value, every scale included (a per-layer config's mean)."""
    return 8 * page_bytes_per_token(kv, kv_heads, head_dim) / (2 * kv_heads * head_dim)


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
              "budget": budget, "max_positions": n,
              "at_max": disk_figures(_limited(probe).at(n), bandwidth.bytes_per_s),
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
    how = "given" if bw["method"] == "given" else f"measured on the folder: {bw['method']}"
    rate = f"{bw['bytes_per_s'] / 1e9:.2f} GB/s ({how})"
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
            lines.append(f"    {o['format']:<13} {o['bits_per_value']:>5.2f} bits  "
                         f"{o['max_positions']:>12,} positions  "
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

    base, planner = engine.config.kv, engine.planner
    if base is None or engine.config.kv_disk is None:
        raise ValueError("pages on disk need KVExec pages and a KV folder (not --kv-format none)")
    layers = planner.edge_footprint().shape.full_layers
    if not layers:
        raise ValueError("this model has no full-attention layer: no page grows with the context, none goes to disk")
    _, kv_heads, head_dim = engine.kv_shape
    others = []
    for name in OTHER_FORMATS:
        kv = replace(base, format=name, layer_formats=())
        if get_format(name).supports_head_dim(head_dim):
            others.append((name, bits_per_value(kv, kv_heads, head_dim),
                           planner.edge_footprint(kv=kv, disk_layers=layers)))
    plan = None
    if context is not None:
        with engine.budget.trial(budget):  # planned under the budget asked about
            _, plan = planner.plan(context)
    return disk_report(planner.edge_footprint(disk_layers=layers), budget, engine.config.kv_disk, bandwidth,
                       bits_per_value(base, kv_heads, head_dim), kv_label(base), plan,
                       engine.config.kv_disk_limit, others)


class DiskStatus:
    """What pages on disk cost the running engine, for /v1/justfit/status: the KV
    folder's bandwidth (measured lazily) and the footprint with every growing layer on
    disk, planned again only when the budget or its measured reserve changes (the event
    loop asks)."""

    def __init__(self, engine):
        cfg = getattr(engine, "config", None)
        folder = getattr(cfg, "kv_disk", None) if getattr(cfg, "kv", None) is not None else None
        self.engine = engine
        self.bandwidth = LazyBandwidth(folder) if folder else None
        self._planned: tuple | None = None  # (budget, reserve), probe, the most positions the budget holds

    def figures(self, bytes_last: int) -> dict:
        """Positions on disk after the last request (`bytes_last` there), bytes on disk and
        read a token per position, and at the trained context and at the most positions the
        budget holds with every growing layer's pages on disk, with the I/O-bound decode
        rate at the folder's bandwidth (None until measured); {} without pages on disk."""
        engine = self.engine
        if self.bandwidth is None:
            return {}
        budget = engine.budget.bytes
        key = (budget, engine.budget.reserve)
        if self._planned is None or self._planned[0] != key:
            probe = engine.planner.edge_footprint(disk_layers=engine.planner.edge_footprint().shape.full_layers)
            self._planned = (key, probe, probe.max_positions(budget) if budget is not None else None)
        _, probe, most = self._planned
        s = probe.shape
        if not s.disk_layers:
            return {}
        per_position = s.page_row * s.disk_layers  # bytes on disk, and read a token, per position on disk
        bw = self.bandwidth.get()
        rate = bw.bytes_per_s if bw is not None else None

        def at(positions: int) -> dict:
            f = disk_figures(_limited(probe).at(positions), rate)
            return {k: f[k] for k in ("positions", "bytes_on_disk", "read_per_token", "resident_total",
                                      "predicted_tok_s")}

        return {"bandwidth": bw.as_dict() if bw is not None else None, "bandwidth_error": self.bandwidth.error,
                "positions_on_disk_last": int(bytes_last / per_position),
                "bytes_per_position": round(per_position),
                "at_context_limit": at(engine.context_limit),
                "at_max": at(most) if most is not None else None,
                "note": "predicted_tok_s: the read's I/O bound on decode, bandwidth / bytes read a token "
                        "(a prediction; compute comes on top)"}

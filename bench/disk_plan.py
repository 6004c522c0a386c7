"""`justfit fit --kv-disk`'s decode prediction against a measured decode with every
layer's pages on disk: the planner's bytes read a token at the measured run's length,
the KV folder's bandwidth as `fit` measures it, and the I/O-bound rate that gives.

    python -m bench.disk_plan --speed bench/results/speed-20261205-123906.json --probes 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", required=True, help="a bench.speed result with a justfit-disk row (cold reads)")
    ap.add_argument("--system", default="justfit-disk")
    ap.add_argument("--probes", type=int, default=3, help="bandwidth measurements on the folder")
    ap.add_argument("--folder", default=None, help="where to measure (default: a temporary folder)")
    ap.add_argument("--bandwidths", default="1.8e9", help="further bandwidths to predict at (bytes/s, comma-separated)")
    args = ap.parse_args(argv)

    from bench.common import machine_info, save
    from justfit import Engine
    from justfit.config import EngineConfig
    from justfit.planning.disk_bandwidth import measure_bandwidth
    from justfit.planning.disk_plan import _limited
    from kvexec import KVConfig

    speed = json.loads(Path(args.speed).read_text())
    row = next(s for s in speed["systems"] if s["system"] == args.system)
    positions, measured = row["context"], row["decode_tps"]
    folder = args.folder or tempfile.mkdtemp(prefix="justfit-disk-plan-")
    engine = Engine(model=row["model"], config=EngineConfig(kv=KVConfig(format="calibrated"), kv_disk=folder))
    base = engine.config.kv
    layers = engine.planner.edge_footprint().shape.full_layers
    # The run's own page mix (`kv_dtype`), its allocated keys as the `c` formats of their mean width (same bytes).
    mix = Counter()
    for part in row["kv_dtype"].removesuffix(" pages").split(", "):
        name, _, n = part.rpartition(" x")
        mix[name.replace("a128", "c128")] += int(n)
    run_kv = replace(base, format=next(iter(mix)), layer_formats=tuple(f for f, n in mix.items() for _ in range(n)))
    planned = {}
    for label, kv in (("this machine's calibration", base), ("the run's mix", run_kv)):
        fp = _limited(engine.planner.edge_footprint(kv=kv, disk_layers=layers)).at(positions)
        planned[label] = {"read_per_token": fp.disk, "read_mib": round(fp.disk / 2**20, 1)}
    read = planned["the run's mix"]["read_per_token"]
    probes = [measure_bandwidth(folder) for _ in range(args.probes)]
    rates = [("given", float(b)) for b in args.bandwidths.split(",") if b] + \
        [("the run's own cold read", speed["disk_read_gbs"] * 1e9)] + [(p.method, p.bytes_per_s) for p in probes]
    predictions = [{"bandwidth_gbs": round(bw / 1e9, 3), "source": src, "predicted_tok_s": round(bw / read, 3),
                    "vs_measured": round(bw / read / measured - 1, 3)} for src, bw in rates]
    result = {"machine": machine_info(), "settings": {"speed": Path(args.speed).stem, "system": args.system,
                                                       "model": row["model"], "positions": positions,
                                                       "layers_on_disk": layers},
              "measured": {"decode_tps": measured, "bytes_on_disk": row["kv_disk"]["bytes_on_disk"],
                           "read_mib": round(row["kv_disk"]["bytes_on_disk"] / 2**20, 1)},
              "planned": planned, "predictions": predictions,
              "note": "predicted_tok_s: bandwidth / bytes read a token, an I/O bound on decode"}
    path = save("diskplan", result)
    print(json.dumps({k: result[k] for k in ("measured", "planned", "predictions")}, indent=1))
    print(path)


if __name__ == "__main__":
    main()

"""`justfit fit`: what a model needs, and how much context fits a budget, before running."""

from __future__ import annotations

from dataclasses import replace

from justfit.memory import format_size
from justfit.planning.cost_model import MIN_PREFILL_CHUNK, cache_layout, footprint
from kvexec import FORMATS, KVConfig, get_format, ladder
from kvexec.calibrate import layer_summary

# llama.cpp's KV cache types the comparison rows show: bytes per K or V value. f16 is
# its default; q8_0 stores blocks of 32 one-byte values with an fp16 scale.
LLAMA_CPP_KV = {"f16": 2.0, "q8_0": 34 / 32}
COMPARISON_NOTE = ("mlx-lm fp16: the KV mlx-lm's users hold (Metal, or float16/bfloat16 weights); mlx-lm fp32: "
                   "only with float32 activations (MLX's CPU backend, as this engine runs); both with the weights as "
                   "stored, all resident (mlx-lm streams none). llama.cpp f16 (its default) and q8_0: K and V per "
                   "position from the model's shapes; max positions: what the budget holds beside the weights as "
                   "stored, its compute buffers not counted (an upper bound)")


def fit_report(engine, budget: int, context: int | None = None, outside: int = 0) -> dict:
    """Weights, bytes per position and maximum retained positions for every KV format,
    resident and with layers offloaded, and the plan for a request of `context` positions,
    within the engine's `budget`; `outside`: what the process holds besides it (a
    whole-process budget is `budget + outside`)."""
    swap, reg = engine.swap, engine.swap.registry
    every_layer = tuple(swap.offload_order())
    head_dim = engine.kv_shape[2]
    base = engine.config.kv
    rows = []
    choices = [(name, replace(base or KVConfig(), format=name, layer_formats=())) for name in FORMATS
               if get_format(name).supports_head_dim(head_dim)]
    if base is not None and base.layer_formats:  # the engine's calibrated per-layer formats
        choices.append((kv_label(base), base))
    if base is None:  # the engine runs mlx-lm's own cache
        choices.append(("mlx-lm", None))
    for name, kv in choices:
        # Capacities at the smallest prefill the planner would take under pressure (the
        # smallest chunk, on the resident forms).
        probe = engine.planner.edge_footprint(kv=kv)
        rows.append({
            "format": name,
            "bytes_per_position": probe.shape.bytes_per_position,
            "transient_bound": engine.planner.footprint(engine.context_limit, kv=kv).transient,
            "max_positions": probe.max_positions(budget),
            "max_positions_offloaded": engine.planner.edge_footprint(every_layer, kv).max_positions(budget),
        })
    rows += comparison_rows(engine, budget)
    report = {
        "model": engine.name, "policy": swap.policy.name, "policy_summary": swap.policy.summary,
        "numerics": engine.numerics.as_dict(), "blas": engine.blas,
        "budget": budget, "outside": outside, "context_limit": engine.context_limit,
        "weights": {"resident": reg.total_bytes(),
                    "by_kind": {k: sum(c.nbytes for c in reg.components.values() if c.kind == k)
                                for k in ("embed", "layer", "head")},
                    "largest_working_copy": swap.working_bytes(),
                    "stored_on_disk": engine.stored_bytes()},
        "kv_format": base.format if base else "mlx-lm",
        "formats": rows,
    }
    # the ladder of a layer whose pages step down: a full one (sliding layers' rings never do)
    steps = [f.label for f in ladder(base, head_dim, first_full_layer(engine.model))] if base else []
    if len(steps) > 1:  # the format in use, its pages stepping down under the budget
        report["pressure"] = {"ladder": steps,
                              "max_positions": engine.planner.edge_footprint(pressed=True).max_positions(budget)}
    if base is not None and engine.config.kv_disk is not None:  # every growing layer's pages on disk
        layers = engine.planner.edge_footprint().shape.full_layers
        edge = engine.planner.edge_footprint(disk_layers=layers)
        report["kv_disk"] = {"folder": engine.config.kv_disk, "layers": layers,
                             "max_positions": edge.max_positions(budget)}
    if context is not None:
        with engine.budget.trial(budget):  # planned under the budget asked about
            offloaded, fp = engine.planner.plan(context)
        report["plan"] = {
            "positions": context, "fits": fp.total <= budget and context <= engine.context_limit,
            "beyond_context": context > engine.context_limit,
            "offloaded": list(offloaded), "footprint": fp.as_dict(),
            "pages": f"stepped down as needed, to {steps[-1]} at most" if fp.shape.page_row < fp.shape.top_row
            else f"kept in {kv_label(base)}" if base else "mlx-lm's cache",
            "prefill": _forms(swap.prefill_forms) if fp.shape.dense_prefill else
            "on the resident weights (no dense working copy: the budget is tight)", "prefill_chunk": fp.shape.chunk,
            "decode": f"resident {reg.resident_form}",
            "kv_layers": {"resident": fp.shape.full_layers - fp.shape.disk_layers, "on_disk": fp.shape.disk_layers,
                          "bytes_on_disk": fp.disk, "read_per_token": fp.disk},
        }
    return report


def comparison_rows(engine, budget: int) -> list[dict]:
    """mlx-lm's and llama.cpp's KV for the same model and budget, each row named for
    what it is (see COMPARISON_NOTE): mlx-lm at float16, and at float32 only where this
    engine computes in float32; llama.cpp's f16 and q8_0."""
    weights = engine.stored_bytes() or engine.swap.registry.total_bytes()
    rows = []
    for dtype, act_bytes in (("fp16", 2), ("fp32", 4)):
        if act_bytes == 4 and not engine.policy.fp32:
            continue

        def mlx_lm(positions: int, chunk: int):
            return footprint(engine.model, engine.model_config, positions, chunk, None, weights, 0, act_bytes,
                             dense_prefill=False, limited=True)

        probe = mlx_lm(1, MIN_PREFILL_CHUNK)
        rows.append({"format": f"mlx-lm {dtype}", "compare": True,
                     "bytes_per_position": probe.shape.bytes_per_position,
                     "transient_bound": mlx_lm(engine.context_limit, engine.config.prefill_chunk).transient,
                     "max_positions": probe.max_positions(budget), "max_positions_offloaded": None})
    full, windows, _, _ = cache_layout(engine.model)
    _, kv_heads, head_dim = engine.kv_shape
    return rows + llama_cpp_rows(kv_heads, head_dim, full, windows, weights, budget)


def llama_cpp_rows(kv_heads: int, head_dim: int, full_layers: int, windows: tuple[int, ...], weights: int,
                   budget: int) -> list[dict]:
    """llama.cpp's f16 and q8_0 KV from a model's shapes: bytes per position over every
    attention layer (sliding ones until their window fills, as its SWA cache holds
    them), and the positions whose KV fits beside `weights` in `budget`."""
    rows = []
    for cache_type, per_value in LLAMA_CPP_KV.items():
        row = 2 * kv_heads * head_dim * per_value  # K and V of one position in one layer

        def kv(positions: int) -> float:
            return row * (full_layers * positions + sum(min(positions, w) for w in windows))

        lo, hi = 0, 1 << 30
        if weights + kv(1) > budget:
            hi = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if weights + kv(mid) <= budget else (lo, mid)
        rows.append({"format": f"llama.cpp {cache_type}", "compare": True,
                     "bytes_per_position": row * (full_layers + len(windows)), "transient_bound": None,
                     "max_positions": lo if hi else 0, "max_positions_offloaded": None})
    return rows


def first_full_layer(model) -> int:
    """The index, among the attention layers, of the first that holds every position."""
    full, windows, sliding, _ = cache_layout(model)
    return next((i for i in range(full + len(windows)) if i not in sliding), 0)


def kv_label(kv: KVConfig) -> str:
    """The KV format's name, and a calibrated one's formats by layer count."""
    return f"{kv.format}: {layer_summary(kv.layer_formats)}" if kv.layer_formats else kv.format


def _forms(forms: dict[str, str]) -> str:
    kinds = sorted(set(forms.values()))
    if kinds == ["dense"]:
        return "each linear materialized dense (fp32) just in time, one at a time, released after its product"
    if kinds == ["resident"]:
        return "resident weights"
    return ", ".join(f"{n}: {f}" for n, f in forms.items())


def format_fit(r: dict) -> str:
    """`fit_report`'s result as readable text: the weights, a row per KV format, and the plan."""
    w = r["weights"]
    budget = format_size(r["budget"])
    if r.get("outside"):
        budget = (f"{format_size(r['budget'] + r['outside'])} for the whole process, {budget} of it the "
                  f"engine's ({format_size(r['outside'])} besides it, measured now; serving adds some)")
    lines = [
        f"model {r['model']} · policy {r['policy']} · budget {budget} · trained context {r['context_limit']}",
        f"  policy: {r['policy_summary']}",
        f"  numerics: {r['numerics']['mode']} (same reply on every path: "
        f"{'yes' if r['numerics']['deterministic'] else 'no'}; {r['numerics']['reason']})",
        f"  blas: {r['blas']}",
        f"weights resident {format_size(w['resident'])} (embedding {format_size(w['by_kind']['embed'])}, "
        f"layers {format_size(w['by_kind']['layer'])}, head {format_size(w['by_kind']['head'])}); "
        f"stored {format_size(w['stored_on_disk'])}; largest working copy {format_size(w['largest_working_copy'])}",
        "",
        f"{'KV format':<{label_width(r)}} {'bytes/pos':>10} {'transient':>11} {'max positions':>14} "
        f"{'layers on disk':>17}",
    ]
    lines += format_rows(r, "(* the format in use; bytes/pos summed over layers, hot window and sinks excluded; "
                            "transient at the trained context and the configured chunk; max positions at the "
                            "smallest chunk, prefilled the cheaper way (resident forms, or one dense linear at a "
                            "time); positions past the trained context "
                            f"{r['context_limit']:,} need a model that extrapolates. {COMPARISON_NOTE})")
    plan = r.get("plan")
    if plan:
        fp = plan["footprint"]
        verdict = "fits" if plan["fits"] else \
            f"does NOT fit: past the trained context {r['context_limit']:,}" if plan.get("beyond_context") \
            else "does NOT fit"
        lines += ["", f"plan for {plan['positions']:,} positions: {verdict} "
                  f"({format_size(fp['total'])} of {format_size(r['budget'])})",
                  f"  weights {format_size(fp['weights'])} + working copy {format_size(fp['working'])} + "
                  f"KV {format_size(fp['kv'])} + transient {format_size(fp['transient'])} + "
                  f"reserve {format_size(fp['reserve'])} ({fp['reserve_from']})",
                  f"  prefill: {plan['prefill']}, {plan['prefill_chunk']} tokens per chunk; "
                  f"decode: {plan['decode']}",
                  f"  KV pages: {plan['pages']}; offloaded from disk: {_names(plan['offloaded'])}"]
        layers = plan.get("kv_layers")
        if layers and layers["on_disk"]:
            lines.append(f"  KV pages of {layers['on_disk']} layers on disk ({layers['resident']} resident): "
                         f"{format_size(layers['bytes_on_disk'])} there, read back every decoded token "
                         f"({format_size(layers['read_per_token'])} per token: at 2 GB/s, "
                         f"{layers['read_per_token'] / 2e9 * 1e3:.0f} ms)")
    return "\n".join(lines)


def format_rows(r: dict, note: str) -> list[str]:
    """The per-format table's rows (the format in use marked, a transient column when the
    report has one), `note` under it, and the pressure ladder's line."""
    lines, width, compared = [], label_width(r), False
    for row in r["formats"]:
        mark = " *" if row["format"].partition(":")[0] == r["kv_format"] else ""
        transient = "" if "transient_bound" not in row else f"{'-':>11} " if row["transient_bound"] is None \
            else f"{format_size(row['transient_bound']):>11} "
        offloaded = row["max_positions_offloaded"]
        if row.get("compare") and not compared:  # other programs' KV, the same model and budget
            lines.append("compared with:")
            compared = True
        lines.append(f"{row['format']:<{width}} {row['bytes_per_position']:>10.0f} {transient}"
                     f"{row['max_positions']:>14,} {'-' if offloaded is None else f'{offloaded:,}':>17}{mark}")
    lines.append(note)
    if r.get("pressure"):
        p = r["pressure"]
        lines.append(f"with pages stepping down {' > '.join(p['ladder'])} under the budget: "
                     f"{p['max_positions']:,} positions")
    if r.get("kv_disk"):
        d = r["kv_disk"]
        lines.append(f"with every layer's pages on disk in {d['folder']} (read back just in time, exact): "
                     f"{d['max_positions']:,} positions")
    return lines


def label_width(r: dict) -> int:
    """The format column's width: the longest label but a calibrated one's (its list of
    layer formats runs over its own row)."""
    return max([10, *(len(row["format"]) for row in r["formats"] if ":" not in row["format"])])


def _names(offloaded: list[str]) -> str:
    layers = sorted(int(n.split(".")[1]) for n in offloaded if n.startswith("layer."))
    parts = [f"{len(layers)} layers ({layers[0]}-{layers[-1]})"] if layers else []
    return ", ".join(parts + [n for n in offloaded if not n.startswith("layer.")]) or "nothing"

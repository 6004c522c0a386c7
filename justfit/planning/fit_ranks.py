"""`justfit fit --ranks N`: what a layer pipeline over N ranks (justfit.pipeline.layers) holds,
planned from one process's engine before launching any: the layers split by the
ranks' budgets, each rank's footprint from its own layers, weights and KV alone."""

from __future__ import annotations

from justfit.pipeline.layers import layer_facts, plan_split, rank_footprint


def ranks_report(engine, budgets: list[int], split=None) -> dict:
    """Per rank: its layers, weights and the most positions its budget holds; the
    pipeline holds the fewest of them. Beside it, one process at the first budget.
    `split`: another split than the one the ranks would plan (for comparison)."""
    reg = engine.swap.registry
    kinds = layer_facts(engine.model)[0]
    layer_bytes = [reg.components[f"layer.{i}"].nbytes for i in range(len(kinds))]
    shared = reg.total_bytes() - sum(layer_bytes)  # embedding and head: rank 0's
    whole = engine.planner.edge_footprint()
    split = split or plan_split(whole, kinds, layer_bytes, shared, budgets)  # as the ranks split (pipeline.attach)
    ranks = []
    for r, budget in enumerate(budgets):
        mine = split.layers(r)
        fp = rank_footprint(whole, kinds, layer_bytes, shared if r == 0 else 0, mine)
        ranks.append({"rank": r, "budget": budget, "layers": [mine.start, mine.stop - 1],
                      "weights": fp.shape.weights, "max_positions": fp.max_positions(budget)})
    return {"ranks": ranks, "max_positions": min(r["max_positions"] for r in ranks),
            "one_process_max_positions": whole.max_positions(budgets[0])}


def format_ranks(r: dict) -> str:
    """`ranks_report`'s result as readable lines."""
    lines = [f"{'rank':>4} {'layers':>9} {'weights':>10} {'budget':>10} {'max positions':>14}"]
    for k in r["ranks"]:
        lines.append(f"{k['rank']:>4} {k['layers'][0]:>4}-{k['layers'][1]:<4} {k['weights'] / 2**20:>7.1f} MiB "
                     f"{k['budget'] / 2**20:>6.0f} MiB {k['max_positions']:>14,}")
    ratio = r["max_positions"] / max(1, r["one_process_max_positions"])
    lines.append(f"the pipeline holds {r['max_positions']:,} positions (its smallest rank); one process at "
                 f"{r['ranks'][0]['budget'] / 2**20:.0f} MiB: {r['one_process_max_positions']:,} ({ratio:.2f}x)")
    if r.get("outside"):  # --whole-process: the budgets shown are the engines' shares
        lines.append(f"(each budget less the {r['outside'] / 2**20:.0f} MiB a process holds besides its engine)")
    return "\n".join(lines)

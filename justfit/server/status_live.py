"""What the status page shows, as one JSON document: memory by kind now and over the
last minutes (a ring of samples taken twice a second: what MLX holds by kind, and the
whole process's RSS beside it), stored states and sessions, running and queued requests
with their progress, the last requests' phases, and the positions that still fit in the
KV format in use and the pressure ladder's next steps, against the trained context."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import mlx.core as mx
import psutil

from justfit.planning.fit import first_full_layer, kv_label
from justfit.memory import rss_bytes
from justfit.server.metrics import acceptance_rate, memory
from kvexec import ladder
from phaseswap.registry import Residency

SAMPLE_EVERY_S = 0.5
HISTORY = 1200  # samples kept: ten minutes at two a second


def kv_bytes_by_format(cache: list | None) -> dict[str, int]:
    """A running request's KV bytes: pages per format, "full" for full-precision rows
    (hot window, sinks, sliding windows, mlx-lm's own caches)."""
    out: dict[str, int] = {}
    for c in list(cache or []):
        store = getattr(c, "store", None)
        total = getattr(c, "nbytes", 0)
        for seg in list(getattr(store, "segments", []) or []):
            out[seg.fmt.name] = out.get(seg.fmt.name, 0) + seg.nbytes
            total -= seg.nbytes
        out["full"] = out.get("full", 0) + max(0, total)
    return out


def materialized_bytes(engine) -> int:
    """Dense working copies PhaseSwap holds right now (a layer leased for prefill: at most
    its largest linear's)."""
    return sum(c.dense_held_nbytes for c in list(engine.swap.registry.components.values())
               if c.state == Residency.MATERIALIZED)


@dataclass
class LiveStatus:
    """The server's status over time; `sample` is called on a timer, `document` per poll."""

    server: object
    samples: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    first_seen: dict = field(default_factory=dict)  # stored state key -> when first seen (its age)
    _capacity: tuple = ()  # (key, rows): capacities for one budget and offloaded set

    def sample(self) -> None:
        """Add a measurement to the history."""
        self.samples.append(self.measure())

    def measure(self) -> dict:
        """Memory by kind now: what MLX holds (the kinds, and its cache of freed buffers),
        the process's RSS (MLX's memory and everything else: interpreter, libraries,
        tokenizer, the server), and the budgets: the engine's, over MLX's memory, and
        a whole-process one, over the RSS."""
        engine = self.server.engine
        try:
            kv = kv_bytes_by_format(self.server.scheduler.live_layers())
        except (RuntimeError, AttributeError):  # the engine thread changed the cache mid-read
            kv = {}
        weights = engine.swap.registry.resident_bytes()
        materialized = materialized_bytes(engine)
        states = engine.states.memory_bytes
        accounted = weights + materialized + sum(kv.values()) + states
        return {"t": round(time.time(), 3), "weights_resident": weights, "weights_materialized": materialized,
                "kv": kv, "states_memory": states, "transient": max(0, mx.get_active_memory() - accounted),
                "mlx_cache": mx.get_cache_memory(), "rss": rss_bytes(),
                "budget": engine.budget.bytes, "process_budget": engine.budget.process}

    def _states(self, now: float, scope: str = "") -> list[dict]:
        """The viewer's own (`scope`'s) stored states; another key's are only counted
        (`other_keys_states` in the document)."""
        tiers = self.server.engine.states
        rows = []
        for key, e in list(tiers.entries.items()):
            seen = self.first_seen.setdefault(key, now)
            if e.scope != scope:
                continue
            rows.append({"name": e.session, "tokens": len(e.tokens),
                         "where": "memory" if e.cache is not None else "disk",
                         "memory_bytes": e.nbytes if e.cache is not None else 0,
                         "disk_bytes": e.disk_bytes if e.path is not None else 0,
                         "age_s": round(now - seen, 1)})
        for key in set(self.first_seen) - set(tiers.entries):
            del self.first_seen[key]
        return sorted(rows, key=lambda r: (r["name"] is None, r["age_s"]))

    def _requests(self, now: float) -> tuple[dict | None, list[dict], list[dict]]:
        sched = self.server.scheduler
        job = sched.running

        def row(j) -> dict:
            return {"route": j.route or "-", "prompt_tokens": len(j.tokens), "max_tokens": j.sampling.max_tokens,
                    "waited_s": round((j.status.started or now) - j.submitted, 2)}

        def computing(j) -> dict:
            s = j.status  # one snapshot, as the engine thread last published it
            return {**row(j), "processed": s.processed, "generated": s.generated,
                    "phase": s.phase or ("decode" if s.generated else "prefill"),
                    "elapsed_s": round(now - (s.started or now), 2)}

        batch = [computing(j) for j in list(sched.active)]  # every request computing (batching)
        return (computing(job) if job is not None else None), batch, [row(j) for j in sched.queued()]

    def _recent(self) -> list[dict]:
        out = []
        for st in reversed(list(self.server.metrics.recent)):
            out.append({"prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
                        "generated_tokens": st.generated_tokens, "queue_s": round(st.queue_s, 3),
                        "prefill_s": round(st.prefill_s, 3), "decode_s": round(st.decode_s, 3),
                        "prefill_tps": round(st.prefill_tps, 1), "decode_tps": round(st.decode_tps, 1),
                        "drafted_tokens": st.drafted_tokens, "accepted_tokens": st.accepted_tokens,
                        "acceptance_rate": acceptance_rate(st.drafted_tokens, st.accepted_tokens),
                        "finish_reason": st.finish_reason, "restored_from": st.restored_from,
                        "kv_disk_bytes": (st.kv_disk or {}).get("bytes_on_disk", 0),
                        "kv_disk_read_mb_s": (st.kv_disk or {}).get("read_mb_s")})
        return out

    def _budget(self) -> tuple[int, str]:
        budget = self.server.engine.budget.bytes
        if budget is not None:
            return budget, "budget"
        return psutil.Process().memory_info().rss + psutil.virtual_memory().available, "memory available"

    def capacity(self, held: int) -> list[dict]:
        """The most positions the budget holds (what `justfit fit` reports) in the KV
        format in use, then with every page in each of the pressure ladder's next steps,
        and how many are still free beside the running requests. `past_context`: more
        than the trained context, which a request never exceeds; such a count is only
        reached by several requests and stored states, or a model that extrapolates."""
        engine = self.server.engine
        budget, _ = self._budget()
        # Re-plan when the budget changes; free memory (no budget) moves all the time: per 64 MiB.
        key = (budget // (2**20 if engine.budget.bytes else 2**26), tuple(engine.swap.offloaded))
        if not self._capacity or self._capacity[0] != key:
            offloaded, base = tuple(engine.swap.offloaded), engine.config.kv
            rows = [{"format": base.format if base else "mlx-lm", "label": kv_label(base) if base else "mlx-lm",
                     "step": 0, "max_positions": engine.planner.edge_footprint(offloaded).max_positions(budget)}]
            steps = ladder(base, engine.kv_shape[2], first_full_layer(engine.model)) if base else []
            for i, fmt in enumerate(steps[1:], 1):  # every page stepped down this far
                kv = replace(base, format=fmt.name, layer_formats=())
                rows.append({"format": fmt.name, "label": fmt.label, "step": i,
                             "max_positions": engine.planner.edge_footprint(offloaded, kv=kv).max_positions(budget)})
            self._capacity = (key, rows)
        limit = engine.context_limit
        return [{**r, "in_use": r["step"] == 0, "left": max(0, r["max_positions"] - held),
                 "past_context": r["max_positions"] > limit} for r in self._capacity[1]]

    def document(self, since: float = 0.0, scope: str = "") -> dict:
        """Everything the page shows to a client of `scope`; the history only after
        `since` (epoch seconds)."""
        engine, now = self.server.engine, time.monotonic()
        running, batch, queued = self._requests(now)
        budget, budget_kind = self._budget()
        held = sum(r["processed"] + r["generated"] for r in batch)  # every computing request's positions
        return {
            "t": round(time.time(), 3), "model": self.server.model_id, "policy": engine.policy.name,
            "blas": engine.blas, "backend": str(mx.default_device()),
            "kv_format": engine.config.kv.format if engine.config.kv else "mlx-lm",
            "context_limit": engine.context_limit, "budget": engine.budget.bytes,
            "process_budget": engine.budget.process,
            "capacity_budget": budget, "capacity_budget_kind": budget_kind,
            "now": self.measure(), "memory": memory(engine),
            "history": [s for s in list(self.samples) if s["t"] > since],
            "states": self._states(now, scope),
            "other_keys_states": sum(1 for e in list(engine.states.entries.values()) if e.scope != scope),
            "running": running, "batch": batch, "queued": queued,
            "recent": self._recent(),
            "capacity": self.capacity(held),
            "requests": {"completed": self.server.scheduler.completed, "failed": self.server.scheduler.failed,
                         "cancelled": self.server.scheduler.cancelled},
        }

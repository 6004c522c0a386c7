"""Counters the server keeps, rendered as Prometheus text and as JSON status."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import mlx.core as mx

from justfit.memory import peak_rss_bytes, rss_bytes


@dataclass
class Metrics:
    """Request and token counters since the server started, and the latest generations' stats."""

    started: float = field(default_factory=time.time)
    requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    prefilled_tokens: int = 0
    decode_seconds: float = 0.0
    decoded_steps: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified
    accepted_tokens: int = 0  # of those, the ones the model agreed with
    last_prefill_tps: float = 0.0
    last_decode_tps: float = 0.0
    kv_disk_read_bytes: int = 0  # KV pages read back from disk (kvexec.disk_pages)
    kv_disk_read_seconds: float = 0.0
    kv_disk_bytes_last: int = 0  # the last request's pages on disk
    kv_disk_read_per_token_last: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=20))  # the last GenerationStats, for the status page

    def observe(self, route: str, status: int) -> None:
        """Count one HTTP response of `route` with `status`."""
        self.requests[(route, status)] += 1

    def record(self, stats) -> None:
        """One finished generation's GenerationStats."""
        if stats is None:
            return
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.completion_tokens += stats.generated_tokens
        self.prefill_seconds += stats.prefill_s
        self.prefilled_tokens += stats.prompt_tokens - stats.cached_tokens
        self.decode_seconds += stats.decode_s
        self.decoded_steps += max(0, stats.generated_tokens - 1)
        self.drafted_tokens += stats.drafted_tokens
        self.accepted_tokens += stats.accepted_tokens
        self.last_prefill_tps, self.last_decode_tps = stats.prefill_tps, stats.decode_tps
        disk = stats.kv_disk or {}
        self.kv_disk_read_bytes += disk.get("bytes_read", 0)
        self.kv_disk_read_seconds += disk.get("read_s", 0.0)
        self.kv_disk_bytes_last = disk.get("bytes_on_disk", 0)
        computed = stats.prompt_tokens - stats.cached_tokens + stats.generated_tokens
        self.kv_disk_read_per_token_last = disk.get("bytes_read", 0) / computed if computed else 0.0
        self.recent.append(stats)

    @property
    def cache_hit_ratio(self) -> float:
        """The share of prompt tokens served from stored state."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def acceptance_rate(drafted: int, accepted: int) -> float | None:
    """The share of drafted tokens the model accepted; None when nothing was drafted."""
    return round(accepted / drafted, 3) if drafted else None


def memory(engine) -> dict[str, int]:
    """Bytes by kind, now."""
    states = engine.states
    return {"weights": engine.swap.registry.resident_bytes(), "states_memory": states.memory_bytes,
            "states_disk": states.disk_bytes, "mlx_active": mx.get_active_memory(),
            "mlx_peak": mx.get_peak_memory(), "mlx_cache": mx.get_cache_memory(),
            "process_rss": rss_bytes(), "process_peak": peak_rss_bytes(),
            "budget": engine.budget.bytes or 0}


def prometheus(m: Metrics, engine, scheduler) -> str:
    """The counters, queue, sessions and memory in Prometheus's text format."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP justfit_{name} {help_}")
        lines.append(f"# TYPE justfit_{name} {kind}")
        lines.extend(f"justfit_{name}{labels} {value:g}" for labels, value in samples)

    metric("requests_total", "counter", "HTTP requests by route and status.",
           [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(m.requests.items())])
    metric("generations_total", "counter", "Generations by outcome.",
           [('{outcome="completed"}', scheduler.completed), ('{outcome="cancelled"}', scheduler.cancelled),
            ('{outcome="failed"}', scheduler.failed), ('{outcome="rejected_busy"}', scheduler.rejected)])
    metric("prompt_tokens_total", "counter", "Prompt tokens received.", [("", m.prompt_tokens)])
    metric("cached_prompt_tokens_total", "counter", "Prompt tokens served from stored state.", [("", m.cached_tokens)])
    metric("completion_tokens_total", "counter", "Tokens generated.", [("", m.completion_tokens)])
    metric("drafted_tokens_total", "counter", "Tokens drafted by speculative decoding and verified.",
           [("", m.drafted_tokens)])
    metric("accepted_tokens_total", "counter", "Drafted tokens the model accepted.", [("", m.accepted_tokens)])
    metric("prompt_cache_hit_ratio", "gauge", "Cached / all prompt tokens since start.", [("", m.cache_hit_ratio)])
    metric("prefill_tokens_per_second", "gauge", "Prefill rate: all time and last request.",
           [('{window="all"}', m.prefilled_tokens / m.prefill_seconds if m.prefill_seconds else 0),
            ('{window="last"}', m.last_prefill_tps)])
    metric("decode_tokens_per_second", "gauge", "Decode rate: all time and last request.",
           [('{window="all"}', m.decoded_steps / m.decode_seconds if m.decode_seconds else 0),
            ('{window="last"}', m.last_decode_tps)])
    metric("memory_bytes", "gauge", "Memory by kind.", [(f'{{kind="{k}"}}', v) for k, v in memory(engine).items()])
    metric("kv_disk_bytes", "gauge", "KV pages on disk: the last request's.", [("", m.kv_disk_bytes_last)])
    metric("kv_disk_read_bytes_total", "counter", "KV pages read back from disk.", [("", m.kv_disk_read_bytes)])
    metric("kv_disk_read_bytes_per_token", "gauge", "KV page bytes read per token computed, last request.",
           [("", m.kv_disk_read_per_token_last)])
    metric("kv_disk_read_bytes_per_second", "gauge", "KV page read throughput since start (reader time only).",
           [("", m.kv_disk_read_bytes / m.kv_disk_read_seconds if m.kv_disk_read_seconds else 0)])
    metric("queue_depth", "gauge", "Requests waiting.", [("", scheduler.waiting)])
    metric("running", "gauge", "Requests computing now.", [("", len(scheduler.active))])
    states = engine.states
    metric("sessions", "gauge", "Named sessions held, every client's.", [("", sum(states.session_counts().values()))])
    metric("session_writes_total", "counter", "Session turns written through to disk, by outcome.",
           [('{outcome="attempted"}', states.writes), ('{outcome="failed"}', states.write_failures)])
    metric("state_spill_failures_total", "counter", "Anonymous states that could not be spilled to disk.",
           [("", states.spill_failures)])
    metric("state_writes_failing", "gauge", "1 while the latest session write or spill failed (see /health).",
           [("", 1 if states.degraded() else 0)])
    metric("sessions_evicted_total", "counter", "Sessions dropped by the disk quota (recent: used in the last "
           "minutes).", [('{recent="false"}', states.ledger.evicted - states.ledger.evicted_recent),
                         ('{recent="true"}', states.ledger.evicted_recent)])
    metric("uptime_seconds", "gauge", "Seconds since the server started.", [("", time.time() - m.started)])
    return "\n".join(lines) + "\n"

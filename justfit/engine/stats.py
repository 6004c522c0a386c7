"""What a generation reports: streamed chunks, and the stats the last one carries."""

from __future__ import annotations

from dataclasses import dataclass, field

from justfit.memory import MemoryReport
from phaseswap import PhaseStats


@dataclass
class GenerationStats:
    """What one generation did: tokens, times, memory and phases."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a stored state
    restored_from: str = ""  # where that state was: "memory", "disk" or "" (none)
    restore_s: float = 0.0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    queue_s: float = 0.0  # waited in the server's queue before running
    preemptions: int = 0  # times the scheduler set this request aside on disk (justfit.engine.scheduler)
    preempted_s: float = 0.0  # time spent set aside
    swap_s: float = 0.0  # writing its state out and reading it back, of that time
    planned_bytes: int = 0  # the planner's footprint for this request (what was checked against the budget)
    prefill_chunk: int = 0  # tokens per prefill chunk: the planner's, smaller under a tight budget
    drafted_tokens: int = 0  # tokens drafted from the sequence's own text and verified (justfit.engine.draft)
    accepted_tokens: int = 0  # of those, the ones the model agreed with (each saved a decode step)
    forced_tokens: int = 0  # reply tokens the grammar forced (justfit.engine.grammar): taken without sampling
    memory: MemoryReport | None = None
    kv_formats: dict[str, int] = field(default_factory=dict)  # paged positions per format, all layers
    kv_disk: dict | None = None  # pages on disk: bytes there, read, read time (justfit.engine.pages.disk_stats)
    phases: list[PhaseStats] = field(default_factory=list)
    # A named session's write-through of this turn (statetrans), awaited before a
    # response's last byte; None for anonymous requests.
    state_write: object = field(default=None, repr=False, compare=False)

    @property
    def prefill_tps(self) -> float:
        """Prefill rate: prompt tokens computed (cached ones excluded) per second."""
        new = self.prompt_tokens - self.cached_tokens
        return new / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Decode rate: tokens per second over the steps after the first token."""
        # The first token comes from prefill's logits; the rest each cost one step.
        steps = max(0, self.generated_tokens - 1)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        """One readable line: tokens, rates and peak memory."""
        mem = f", peak {self.memory.mlx_peak / 2**20:.0f} MiB MLX / {self.memory.rss_peak / 2**20:.0f} MiB process" if self.memory else ""
        return (f"{self.prompt_tokens} prompt tokens ({self.cached_tokens} cached) at "
                f"{self.prefill_tps:.1f} tok/s, {self.generated_tokens} generated at "
                f"{self.decode_tps:.1f} tok/s{mem}")


@dataclass
class Chunk:
    """One piece of streamed output; the last one carries finish_reason and stats."""

    text: str
    token: int | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprob: float | None = None  # the token's, when SamplingParams.logprobs asked
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely tokens there, best first


@dataclass
class Reply:
    """A whole reply: its text, its tokens and the stats of the request that made it."""

    text: str
    tokens: list[int]
    stats: GenerationStats | None


def collect(chunks) -> Reply:
    """Gather streamed chunks into one Reply (stats from the last chunk that has them)."""
    text, tokens, stats = [], [], None
    for c in chunks:
        text.append(c.text)
        if c.token is not None:
            tokens.append(c.token)
        stats = c.stats or stats
    return Reply("".join(text), tokens, stats)

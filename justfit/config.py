"""Request and engine settings, as frozen dataclasses: change one with
`dataclasses.replace`, never in place (an engine keeps its own copy)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvexec import KVConfig
from phaseswap.policy import get_policy


@dataclass(frozen=True)
class OutputConstraint:
    """A grammar the reply must follow (constrained decoding, justfit.engine.grammar).

    kind: "json_schema" (text: a JSON Schema, as JSON), "json_object" (any JSON
    object; text ignored), "regex", "lark" (llguidance's Lark dialect) or "gbnf"
    (llama.cpp's grammar format, converted to Lark). Two constraints with the same
    kind and text compile to the same grammar (the compile cache's key)."""

    kind: str
    text: str = ""

    KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(self.KINDS)}, not {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    The defaults are the fallback for a model that recommends no sampling of its own
    (justfit.model.models.recommended_sampling reads what one does): temperature 0.6 and
    top-p 0.9, as Llama 3's makers ship; small models wander at 0.7 without a top-p."""

    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per earlier occurrence of a token
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token seen before
    logprobs: int | None = None  # report each token's logprob and this many top alternatives
    seed: int | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    speculate: bool = True  # draft tokens from the sequence's own text when the engine drafts (EngineConfig.draft)
    constraint: OutputConstraint | None = None  # the grammar the reply follows; None: free text
    # Tokens the grammar forces go into the next step's forward together (no forward of
    # their own); False feeds them one a step (the same reply: benchmarks compare the two).
    force_tokens: bool = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.min_p < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k and min_p must be >= 0, repetition_penalty > 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs (top alternatives) must be in [0, 20]")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    policy: PhaseSwap's named policy (phaseswap.POLICIES): "cpu" keeps 8-bit decode
    weights and materializes each layer in fp32 for prefill, "dense" keeps all fp32,
    "quantized" the stored weights (Metal), "auto" picks cpu or quantized by backend.
    budget_bytes bounds the memory the engine manages (weights, KV, transients); with
    budget_covers_process, the whole process (what it holds besides MLX at load, the
    interpreter, libraries and tokenizer, is taken off). Under a budget on CPU, "auto"
    picks cpu-compact when cpu's weights leave too little for the whole context. The
    engine keeps the budget at load here; the one now (a whole-process budget's share,
    `Engine.set_budget`) is `Engine.budget` (justfit.planning.budget.Budget).
    """

    budget_bytes: int | None = None
    budget_covers_process: bool = False  # the budget includes what the process holds outside MLX
    # Under a budget, layers (then the head) may be offloaded: left on disk and read in as
    # each is needed; False keeps every weight resident and refuses what would need it.
    offload_weights: bool = True
    policy: str = "auto"
    prefill_chunk: int = 512
    gguf_bits: int | str = "native"  # see justfit.model.gguf.convert
    gguf_embed_bits: int = 8
    context_limit: int | None = None  # defaults to the model's trained context
    kv: KVConfig | None = field(default_factory=KVConfig)  # None: mlx-lm's own KV cache
    # Stored states (prefix cache and sessions, statetrans.StateTiers): the memory tier
    # holds at most state_memory bytes (None: a quarter of RAM; with a budget, also what
    # the budget leaves) and spills to state_dir (None: $JUSTFIT_STATE_DIR or
    # ~/.cache/justfit/state), which holds at most state_disk bytes (None: the smaller
    # of 20 GiB and half its free space): named sessions session_disk of it (None: 3/4),
    # least recently used first past that (one used in the last session_keep_s seconds
    # only when nothing older is left), anonymous states the rest, and the quarantine
    # (statetrans.quarantine) 1/20 of the total out of their part. A server with API keys
    # gives each key an equal share of both parts (StateTiers.share_among).
    state_memory: int | None = None
    state_disk: int | None = None
    state_dir: str | None = None
    session_disk: int | None = None
    session_keep_s: float = 600.0
    # KV pages on disk (kvexec.disk_pages): under a budget, the planner may keep some
    # layers' pages in files in kv_disk (None: never) and read them back just in time, at
    # most kv_disk_limit bytes a request (None: half the folder's free space, a tenth of
    # the disk kept free); kv_disk_layers puts that many growing layers' pages there
    # whatever the budget (None: as the plan needs); kv_disk_cached leaves what was read
    # in the OS page cache (faster; that memory is outside any budget).
    kv_disk: str | None = None
    kv_disk_limit: int | None = None
    kv_disk_layers: int | None = None
    kv_disk_cached: bool = False
    # One numerics per token (justfit.engine.numerics): a reply does not depend on how a
    # token was computed (a cached prefix, the prefill chunk, a batch, a draft); one row
    # per forward where no row-invariant kernels run. Off: prefill on the dense forms,
    # faster (docs/BENCHMARKS.md, "Same request, same reply", says by how much).
    deterministic: bool = False
    # Speculative decoding without a draft model: "ngram" drafts tokens from the longest
    # earlier match of the sequence's own suffix (prompt and reply) and verifies them in
    # one forward; "none" decodes one token per step. Replies are the same either way.
    draft: str = "ngram"
    # Decode steps pipelined: where a step's next tokens need nothing from the host (plain
    # greedy, or sampled with the request's keys), the next step's forward is built from
    # them unevaluated and dispatched before this step's tokens are taken, stop text and
    # detokenizing done while it computes (justfit.engine.batch.Pipeline). Replies and
    # stored states are the same either way; off: each step waits, then the next is built.
    pipeline: bool = True
    # Compiled grammars (constrained output, justfit.engine.grammar) kept by content, at
    # most this many bytes (estimated); a whole-process budget counts it from load.
    grammar_cache_bytes: int = 32 << 20
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", dict(self.extra))  # a copy: the caller's dict is never shared
        get_policy(self.policy)  # raises on an unknown name
        if self.draft not in ("ngram", "none"):
            raise ValueError(f"draft must be 'ngram' or 'none', not {self.draft!r}")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")

"""Request and engine settings, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvexec import KVConfig


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.min_p < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k and min_p must be >= 0, repetition_penalty > 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.stop = tuple(s for s in self.stop if s)


@dataclass
class EngineConfig:
    """How the engine runs a model.

    compute: "dense" materializes fp32 weights (fast GEMM on the CPU backend),
    "quantized" keeps the stored quantized weights (compact; Metal kernels are fast),
    "auto" picks dense on CPU and quantized on GPU.
    """

    budget_bytes: int | None = None
    compute: str = "auto"
    prefill_chunk: int = 512
    gguf_bits: int | str = "native"  # see justfit.gguf_import
    gguf_embed_bits: int = 8
    context_limit: int | None = None  # defaults to the model's trained context
    kv: KVConfig | None = field(default_factory=KVConfig)  # None: mlx-lm's own KV cache
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.compute not in ("auto", "dense", "quantized"):
            raise ValueError(f"compute must be auto, dense or quantized, not {self.compute!r}")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")

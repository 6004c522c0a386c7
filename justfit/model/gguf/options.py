"""How a GGUF file is converted: the options, the converter's version and the error for
what it cannot convert. Shared by the converter (justfit.model.gguf.convert) and its cache
(justfit.model.gguf.cache), which imports the converter only when it has to convert."""

from __future__ import annotations

from dataclasses import dataclass

CONVERTER_VERSION = 5


class UnsupportedModel(ValueError):
    """A model this program cannot convert or load (an architecture or feature not supported)."""
    pass


@dataclass(frozen=True)
class RequantOptions:
    """How a GGUF file's weights are converted (see justfit.model.gguf.convert's module doc)."""

    bits: int | str = "native"  # "native", "exact", or re-quantize at 2, 3, 4, 5, 6, 8
    embed_bits: int = 8

    def __post_init__(self) -> None:
        if self.bits not in ("exact", "native") and int(self.bits) not in (2, 3, 4, 5, 6, 8):
            raise ValueError(
                f"GGUF re-quantization bits must be 2-6, 8, 'native' or 'exact', not {self.bits!r}")
        if self.embed_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"embedding bits must be 2-6 or 8, not {self.embed_bits!r}")

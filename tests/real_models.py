"""The real pretrained model files tests use, fetched by `rl models fetch NAME` (model/registry.py).

Without the file a test skips locally with the command that gets it; under CI=true (.ci/run fetches it)
it fails instead, so CI never passes without the real-model tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model.registry import model_path


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF): $ASYNCRL_SMOLLM2_GGUF, else where `rl models fetch` puts it."""
    path = Path(os.environ.get("ASYNCRL_SMOLLM2_GGUF") or model_path("smollm2-135m-instruct"))
    if not path.is_file():
        msg = f"SmolLM2 GGUF not at {path}: run `rl models fetch smollm2-135m-instruct`"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path

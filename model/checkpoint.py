"""Checkpoint I/O: a directory with `config.json` (ModelConfig) and `model.safetensors`, and the one
atomic directory writer that every checkpoint of this project goes through.

`publish_directory` is that writer: the files are written into a temporary sibling directory, fsynced,
then `MANIFEST.json` (size and blake2b digest of every other file) is written last and fsynced, the
directory is renamed into place (`os.replace`) and the parent directory fsynced. A reader therefore
never sees a half-written checkpoint, and `verify_files` tells a complete one from one damaged later.
rl/checkpoint/format.py (resumable training checkpoints) uses the same writer with its own manifest fields.

Loading reads safetensors and JSON only: nothing in a checkpoint directory can run code. Reading a checkpoint as a
model (`read_weights`, `load_weights_into`, `load_checkpoint`) lives in model/pretrained.py beside the other weight
sources, since a LoRA checkpoint of adapters alone is read on top of its base, which may be any of them.
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
from model.config import ModelConfig
from model.decoder import Decoder
from model.formats import CheckpointFormatError
from model.lora import is_adapter

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
BASE_FILE = "base.json"
"""A LoRA run's checkpoint (issue #44) holds its adapters alone in `model.safetensors` (every `lora_A` and `lora_B`,
float32) when the frozen base is a file: `base.json` names that base, {"source": as the recipe gave it, "path":
resolved, "sha256": {weight file: hex digest}}. An 8B base is 16 GB, its adapters at rank 32 0.35 GB; every
reader puts the base back (model/pretrained.py `read_weights`, `load_weights_into`), after checking its files still
have those digests."""

_DIGESTS: dict[tuple, str] = {}
"""sha256 of a file by (resolved path, size, mtime): a base is hashed once a process, not at every checkpoint."""


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def base_identity(source: str | Path) -> dict:
    """`base.json` of a base checkpoint (a GGUF file, a Hugging Face directory, an asyncrl checkpoint directory, or a
    name `rl models fetch` knows): where it is and the sha256 of each of its weight files."""
    from model.formats import checkpoint_kind, hf_weight_files
    from model.registry import resolve_model_source

    path = Path(resolve_model_source(source)).resolve()
    kind = checkpoint_kind(path)
    if kind == "gguf":
        files = [path]
    elif kind == "hf":
        files = hf_weight_files(path)
    else:  # an asyncrl checkpoint; an adapters-only one pins its own base through its base.json
        files = [f for f in (path / "model.safetensors", path / BASE_FILE) if f.is_file()]
    return {"source": str(source), "path": str(path),
            "sha256": {str(f.relative_to(path)) if f != path else f.name: _sha256(f) for f in files}}


def base_record(directory: str | Path) -> dict | None:
    """The base a checkpoint of LoRA adapters alone was trained on (`base.json`), or None: the checkpoint holds every
    weight."""
    f = Path(directory) / BASE_FILE
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
        if not (isinstance(record.get("path"), str) and isinstance(record.get("sha256"), dict) and record["sha256"]):
            raise ValueError("no path and sha256")
    except (ValueError, AttributeError) as e:
        raise CheckpointFormatError(f"{f}: not a base record ({str(e).splitlines()[0][:80]})") from None
    return record


def check_base(directory: str | Path, record: dict, against: str | Path | None = None) -> Path:
    """The base's path, once its weight files (at `against`, default the recorded path) have the recorded digests;
    CheckpointFormatError in one line otherwise: adapters on another base are another model."""
    where = Path(directory)
    recorded = next(iter(record["sha256"].values()))[:12]
    path = Path(record["path"]) if against is None else against
    try:
        now = base_identity(path)
    except (CheckpointFormatError, OSError) as e:
        raise CheckpointFormatError(f"{where}: its LoRA adapters were trained on the base {record['path']} (sha256 "
                                    f"{recorded}...), which cannot be read now ({str(e).splitlines()[0][:120]})") from None
    if now["sha256"] != record["sha256"]:
        got = next(iter(now["sha256"].values()), "none")[:12]
        other = "whose weight files changed since" if now["path"] == record["path"] else f"not on {now['path']}"
        raise CheckpointFormatError(f"{where}: its LoRA adapters were trained on the base {record['path']} (sha256 "
                                    f"{recorded}...), {other} (sha256 {got}...): adapters on another base are another "
                                    "model; put that base back, or start a new run")
    return Path(now["path"])


def write_weights(model: Decoder, directory: str | Path, state: dict[str, torch.Tensor] | None = None,
                  base: str | Path | None = None) -> None:
    """`model.safetensors` and `config.json` into an existing directory (no rename). `state`: the full
    state_dict when the model's own holds shards (FSDP2, rl/train/parallel.py), or a host copy of it. `base`: the
    file a LoRA model's frozen weights came from: then only the adapters are written, and `base.json` (`BASE_FILE`)."""
    directory = Path(directory)
    state = model.state_dict() if state is None else state
    adapters_only = model.config.lora is not None and base is not None
    if adapters_only:
        state = {k: v for k, v in state.items() if is_adapter(k)}
        (directory / BASE_FILE).write_text(json.dumps(base_identity(base), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    # `init` said where the weights came from; they are in this checkpoint now (or base.json says where the base is).
    config = model.config.model_copy(update={"init": None})
    (directory / "config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))


def saved_tensors(path: Path, device) -> dict[str, torch.Tensor]:
    file = path / "model.safetensors"
    state = load_file(str(file), device=str(device))
    for name, t in state.items():
        check_finite(t, name, file)
    return state


def check_finite(t: torch.Tensor, name: str, where: str | Path) -> torch.Tensor:
    """`t`, unless it is a floating-point tensor holding NaN or inf: then CheckpointFormatError naming the file and the
    tensor. Every weight read (model/pretrained.py `read_weights` and `load_pretrained_into`) passes here: NaN weights
    train NaN from the first step, and a model must be refused at load rather than trained with exit 0."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointFormatError(f"{where}: tensor {name} holds non-finite values (NaN or inf): refusing to load it")
    return t


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

"""Resumable checkpoints (seed §5.1.2: preemptible pools; §5.2.3: in-flight state persistence).

A checkpoint is one directory `RUN_DIR/checkpoints/step-<global step>-<n>/`:

  model.safetensors, config.json   policy weights (rank 0; data-parallel ranks hold identical weights)
  trainer.pt                       optimizer and LR-schedule state and torch RNG state of the current stage
  inflight-w<r>.msgpack            worker r's in-flight `RolloutState`s: KV cache in its storage format,
                                   routing trace so far, tokens, behaviour logprobs, per-token versions,
                                   and requests not yet admitted (no KV)
  controller.pkl                   stage index, step within the stage, global step, minutes spent in the
                                   stage, dispatcher state (sampling RNG, prompt counter, open and ready
                                   groups with their sample ids, credit, discard/drop counters), each
                                   dataset stream's cursor, the prompts in flight, the ids of finished but
                                   untrained samples, and the store watermark
  MANIFEST.json                    written last: size and blake2b digest of every other file

It is written under `.tmp-...` and renamed into place, so a directory without `.tmp-` is complete
unless a file was later damaged; `latest()` checks the manifest and skips (with a warning) any
checkpoint that fails it, in favour of the one before. The newest `keep_last` are kept.

Consistency rule on resume (kill -9 included): the job restarts from the checkpoint exactly; the
trajectory store is rolled back to the checkpoint's watermark (rl/store.py `rollback_to`): work done
after it is redone with the same prompt and sample ids, samples finished but untrained at the
checkpoint are trained once, by the first train step that takes their group, and a train step that
ran after the checkpoint is forgotten together with the weights it produced. So no sample is ever
consumed by two train steps of the surviving history, and every trained sample links to its step.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from rl.faults import fault_point

MANIFEST = "MANIFEST.json"
CONTROLLER = "controller.pkl"
FORMAT_VERSION = 1


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inflight_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"inflight-w{rank}.msgpack"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the recipe."""


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 3, warn: Callable[[str], None] = print):
        self.root, self.keep_last, self.warn = Path(root), keep_last, warn

    # -- writing -------------------------------------------------------------------------------------
    def begin(self, global_step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `global_step`; fill it, then `commit`."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # a write a kill interrupted
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-step-{global_step:08d}-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, global_step: int, controller_state: dict) -> Path:
        """Write the controller state and the manifest, then rename into place and prune old ones."""
        with (tmp / CONTROLLER).open("wb") as f:
            pickle.dump(controller_state, f, protocol=pickle.HIGHEST_PROTOCOL)
        files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        manifest = {"format": FORMAT_VERSION, "global_step": global_step, "created_at": time.time(),
                    "files": {p.name: {"bytes": p.stat().st_size, "blake2b": _digest(p)} for p in files}}
        for p in files:
            with p.open("rb") as f:
                os.fsync(f.fileno())
        fault_point("checkpoint_write")
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        taken = [int(p.name.rsplit("-", 1)[1]) for p in self.root.glob(f"step-{global_step:08d}-*")]
        final = self.root / f"step-{global_step:08d}-{max(taken, default=-1) + 1:03d}"
        os.replace(tmp, final)
        _fsync_dir(self.root)
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    # -- reading -------------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Renamed-into-place checkpoints, oldest first (not yet verified)."""
        return sorted(p for p in self.root.glob("step-*") if p.is_dir()) if self.root.is_dir() else []

    @staticmethod
    def problem(path: Path) -> str | None:
        """Why `path` is not a usable checkpoint, or None."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            return "no MANIFEST.json"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "MANIFEST.json is not valid JSON"
        if manifest.get("format") != FORMAT_VERSION:
            return f"format {manifest.get('format')!r}, expected {FORMAT_VERSION}"
        for name, meta in manifest.get("files", {}).items():
            p = path / name
            if not p.is_file():
                return f"{name} is missing"
            if p.stat().st_size != meta["bytes"]:
                return f"{name} has {p.stat().st_size} bytes, the manifest says {meta['bytes']}"
            if _digest(p) != meta["blake2b"]:
                return f"{name} does not match its digest"
        if CONTROLLER not in manifest.get("files", {}):
            return f"{CONTROLLER} is not in the manifest"
        return None

    def latest(self) -> Path | None:
        """The newest checkpoint that passes its manifest; damaged ones are skipped with a warning."""
        for path in reversed(self.complete()):
            why = self.problem(path)
            if why is None:
                return path
            self.warn(f"warning: skipping checkpoint {path}: {why}")
        return None

    @staticmethod
    def controller_state(path: Path) -> dict:
        with (path / CONTROLLER).open("rb") as f:
            return pickle.load(f)

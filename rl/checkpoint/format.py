"""Resumable checkpoints, format 2 (seed §5.1.2: preemptible pools; §5.2.3: in-flight state persistence).

One family, one finder, one writer. Every checkpoint is a directory
`RUN_DIR/checkpoints/step-<global step, 8 digits>-<n, 3 digits>/` (n tells apart two checkpoints of the
same step), written every `checkpoint.every_steps` train steps, on the first SIGTERM/SIGINT, and at every
stage end. A *stage-end* checkpoint is an ordinary resumable one whose manifest (and driver record) also
carries `stage_end = {stage, type, eval}`: the stage's index, type and held-out evaluation. Pruning keeps
the newest `keep_last` checkpoints plus every stage-end one. `CheckpointManager.latest()` is the one finder
(resume, `rl eval`, benches); `model.checkpoint.publish_directory` is the one atomic writer.

Files of a checkpoint directory:

  file                       written by  content
  model.safetensors          rank 0      policy weights (data-parallel ranks hold identical weights)
  config.json                rank 0      the ModelConfig (model/checkpoint.py)
  base.json                  rank 0      a LoRA run on a base file: model.safetensors holds the adapters alone,
                                         and this names the base (path, sha256 of its weight files); resume
                                         refuses another base (model/checkpoint.py BASE_FILE)
  trainer.json               rank 0      {format: 2, tree: tensor tree (below) of {optimizer, scheduler,
                                         torch_rng, cuda_rng}}: the current stage's AdamW and LR-schedule
                                         state_dicts (null before a stage's trainer exists) and torch RNGs
  trainer.safetensors        rank 0      the tensors that trainer.json refers to (moments, steps, RNG bytes)
  inflight-w<r>.msgpack      rank r      msgpack array of byte strings, one `RolloutState.to_bytes()` per
                                         in-flight sample of worker r (KV cache in its storage format,
                                         routing trace so far, tokens, logprobs, versions; requests not yet
                                         admitted have no KV; with tools, the sample's sandbox work directory
                                         as its pending call found it, a gzip'd tar: rl/runtime/tool_turns.py, seed
                                         §5.1.3); layout (rollout/types.py) versioned by the
                                         manifest's `rollout_state_format`; only files the manifest lists are read
  controller.json            driver      the controller records (below)
  MANIFEST.json              last        {format: 2, global_step, created_at, rollout_state_format,
                                         stage_end: null | {stage, type, eval}, files: {name: {bytes, blake2b}}}

controller.json = {format: 2, driver: Driver, stage: SFTLoop | AsyncLoop} (rl/algo/records.py), all
plain JSON: no class names, so renaming a Python class never breaks a resume.

  Driver      {stage_idx, stage_type, global_step, stage_minutes, summary {key: float}, recipe_yaml,
               num_workers, watermark {seq, train_step}, stage_end: null | {stage, type, eval {metric: float}}}
  SFTLoop     {step, drawn, rng: RandomState}                                (stage_type sft)
  AsyncLoop   {dispatcher: Dispatcher, streams {dataset: drawn}, prompts {prompt_id: {prompt: Prompt,
               problem: Problem}}, finished {prompt_id: [sample_id]} (finished, untrained), effort_of
               {sample_id: int | null}, clock: Clock, step, live: Live, teacher_of {prompt_id: str | null}}
                                                                             (stage_type grpo, opd)
  Dispatcher  {counter, version, train_steps, stats: Stats, credit, batches_owed, inflight {dataset: int},
               open [Group], ready [Group] (oldest first), pending_draw: str | null, discarded [prompt_id],
               closed [[prompt_id, outcome]], rng: RandomState}                (rl/dispatch.py)
  Group       {ticket {prompt_id, dataset, group_size, version}, done [{sample_id, prompt_id, num_tokens,
               min_version}], discarded: bool}
  Stats       {dispatched_prompts, dispatched_samples, cap_skips, discarded_samples, dropped_stale_groups,
               lag_waits, frac_waits, capacity_waits, filtered_groups (the last two absent from older
               checkpoints: 0)}
  Prompt      {prompt_id, dataset, text, tokens [int], answer, group_size, policy_version, config_version}
  Problem     the task's problem, field by field (ckpt_records.problem_to_record: the one place to adapt)
  Clock       {concurrency [float], interrupt_s [float], interrupt_late_steps [int], rollout_s, train_s,
               generated_tokens, bytes_moved, pipelined_calls (absent from older checkpoints: 0), ...,
               concurrency_sum, concurrency_calls (absent from older checkpoints: from their whole concurrency
               list); concurrency holds the last RolloutClock's window of calls}
  Live        {version, mixture {dataset: float}, caps {dataset: int}, assignment {dataset: teacher},
               teachers {name: {name, checkpoint, datasets}}, history [{version, status, train_step, time, patch}]}
  RandomState [version, [int] * 625, gauss_next | null]          (Python's random.Random.getstate())

Tensor tree (trainer.json), a tagged JSON encoding of nested containers: null, bool, int, float and str
stand for themselves; {"list": [...]}, {"tuple": [...]}; {"dict": [[key, value], ...]} with str or int keys
kept as such (AdamW's state is keyed by parameter index); {"tensor": NAME}, an entry of trainer.safetensors.

Loading never executes code from the run directory: the manifest is checked first (sizes, digests, then the
JSON and safetensors headers); JSON, safetensors and plain msgpack (no extension types) are the only
decoders; there is no pickle and no torch.load. A checkpoint of
another format (format 1: a pickled controller.pkl) is refused with one line (CheckpointError, exit 2),
never skipped: falling back to an older checkpoint, or to the start, would roll the store back over work
the run has done. A damaged checkpoint of this format (a file missing, truncated or changed) is skipped with
a warning in favour of the one before it.

Consistency rule on resume (kill -9 included): the job restarts from the checkpoint exactly; the
trajectory store is rolled back to the checkpoint's watermark (rl/store/trajectories.py `rollback_to`): work done
after it is redone with the same prompt and sample ids, samples finished but untrained at the
checkpoint are trained once, by the first train step that takes their group, and a train step that
ran after the checkpoint is forgotten together with the weights it produced. So no sample is ever
consumed by two train steps of the surviving history, and every trained sample links to its step.

API: `CheckpointManager(root, keep_last, warn)`: `begin(step) -> tmp dir` (the workers fill it),
`commit(tmp, step, controller_record, stage_end=None) -> path`, `latest(stage_end_only=False)`, `complete()`,
`problem(path)`, `stage_end(path)`, `inflight_files(path)`, `controller_state(path)`; `save_tree` /
`load_tree` for the trainer state; the records themselves are built and parsed in rl/algo/records.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from model.checkpoint import BASE_FILE, publish_directory, read_manifest, verify_files
from rl.faults import fault_point
from rollout.types import ROLLOUT_STATE_FORMAT

FORMAT_VERSION = 2
CONTROLLER = "controller.json"
TRAINER_JSON, TRAINER_TENSORS = "trainer.json", "trainer.safetensors"
REQUIRED = (CONTROLLER, TRAINER_JSON, TRAINER_TENSORS, "model.safetensors", "config.json")
FORMAT_1_CONTROLLER = "controller.pkl"
"""Only ever looked for by name, to recognise (and refuse) a format-1 checkpoint; never opened."""


def inflight_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"inflight-w{rank}.msgpack"


class CheckpointError(RuntimeError):
    """No usable checkpoint, one of another format, or one that does not fit the recipe (one line)."""


# -- plain records ------------------------------------------------------------------------------------------
def check_plain(obj, where: str = "record") -> None:
    """Raise TypeError unless `obj` is JSON as written and read back unchanged: dicts with str keys, lists,
    str, int, float, bool, None. (A tuple or an int key would come back changed; an object has no place.)"""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return
    if isinstance(obj, list):
        for i, x in enumerate(obj):
            check_plain(x, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a str")
            check_plain(v, f"{where}.{k}")
    else:
        raise TypeError(f"{where}: {type(obj).__name__} is not a plain record value")


# -- tensor trees: JSON skeleton + safetensors (trainer state) ----------------------------------------------
def flatten_tree(tree) -> tuple[object, dict[str, torch.Tensor]]:
    """Nested dicts/lists/tuples/scalars/tensors -> (tagged JSON skeleton, {name: tensor}); see the
    module docstring for the tags."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x):
        if x is None or isinstance(x, (str, bool, int, float)):
            return x
        if isinstance(x, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = x.detach().cpu().contiguous()
            return {"tensor": name}
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [enc(v) for v in x]}
        if isinstance(x, dict):
            bad = [k for k in x if isinstance(k, bool) or not isinstance(k, (str, int))]
            if bad:
                raise TypeError(f"tensor tree: dict key {bad[0]!r} is neither str nor int")
            return {"dict": [[k, enc(v)] for k, v in x.items()]}
        raise TypeError(f"tensor tree: cannot store a {type(x).__name__}")

    return enc(tree), tensors


def unflatten_tree(skeleton, tensors: dict[str, torch.Tensor]):
    """Inverse of `flatten_tree`; ValueError on a malformed skeleton or a missing tensor."""

    def dec(x):
        if x is None or isinstance(x, (str, bool, int, float)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise ValueError(f"tensor tree: malformed node {str(x)[:60]}")
        (tag, v), = x.items()
        if tag == "tensor":
            if v not in tensors:
                raise ValueError(f"tensor tree: no tensor {v!r}")
            return tensors[v]
        if tag in ("list", "tuple") and isinstance(v, list):
            items = [dec(i) for i in v]
            return items if tag == "list" else tuple(items)
        if tag == "dict" and isinstance(v, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in v):
            return {k: dec(val) for k, val in v}
        raise ValueError(f"tensor tree: malformed {tag!r} node")

    return dec(skeleton)


def save_tree(tree, directory: str | Path, json_name: str = TRAINER_JSON, tensors_name: str = TRAINER_TENSORS) -> None:
    skeleton, tensors = flatten_tree(tree)
    save_file(tensors, str(Path(directory) / tensors_name), metadata={"format": str(FORMAT_VERSION)})
    (Path(directory) / json_name).write_text(json.dumps({"format": FORMAT_VERSION, "tree": skeleton}))


def _tree_skeleton(directory: str | Path, json_name: str):
    doc = json.loads((Path(directory) / json_name).read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"{json_name}: not a format-{FORMAT_VERSION} tensor tree")
    return doc["tree"]


def load_tree(directory: str | Path, json_name: str = TRAINER_JSON, tensors_name: str = TRAINER_TENSORS):
    return unflatten_tree(_tree_skeleton(directory, json_name), load_file(str(Path(directory) / tensors_name)))


class FileTensor:
    """A tensor of a tree left in its safetensors file (`open_tree`): `read(rows)` reads rows `rows` of dim 0
    only (a safetensors slice; None: the whole tensor). A data-parallel rank that keeps a shard of the AdamW
    moments reads just its rows (rl/train/parallel.py)."""

    def __init__(self, file, name: str):
        self._file, self.name = file, name
        self.shape = tuple(file.get_slice(name).get_shape())

    def read(self, rows: range | None = None) -> torch.Tensor:
        return self._file.get_tensor(self.name) if rows is None else self._file.get_slice(self.name)[rows.start : rows.stop]


@contextmanager
def open_tree(directory: str | Path, json_name: str = TRAINER_JSON, tensors_name: str = TRAINER_TENSORS):
    """`load_tree` with every tensor a `FileTensor` (nothing read yet), readable inside the `with`."""
    skeleton = _tree_skeleton(directory, json_name)
    with safe_open(str(Path(directory) / tensors_name), framework="pt") as f:
        yield unflatten_tree(skeleton, {k: FileTensor(f, k) for k in f.keys()})


def read_tree(tree):
    """`tree` with every `FileTensor` read whole."""
    if isinstance(tree, FileTensor):
        return tree.read()
    if isinstance(tree, (list, tuple)):
        return type(tree)(read_tree(v) for v in tree)
    if isinstance(tree, dict):
        return {k: read_tree(v) for k, v in tree.items()}
    return tree


# -- the manager --------------------------------------------------------------------------------------------
def _format_error(path: Path, fmt) -> CheckpointError:
    if fmt == 1:
        what = f"pickled controller state, written before format {FORMAT_VERSION}"
    elif isinstance(fmt, int) and fmt > FORMAT_VERSION:
        what = "written by a newer asyncrl"
    else:
        what = "not a format this asyncrl knows"
    return CheckpointError(f"checkpoint {path} has format {fmt} ({what}); this asyncrl reads format {FORMAT_VERSION}: "
                           f"start a new run directory")


def _unreadable(path: Path) -> str | None:
    """Why a checkpoint whose digests match still cannot be read (a manifest rewritten to fit other
    files), or None. Reads JSON and safetensors headers only."""
    try:
        doc = json.loads((path / CONTROLLER).read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
            return f"{CONTROLLER} is not a format-{FORMAT_VERSION} controller record"
        tree = json.loads((path / TRAINER_JSON).read_text())
        for name in ("model.safetensors", TRAINER_TENSORS):
            with safe_open(str(path / name), framework="pt") as f:
                keys = list(f.keys())
        if not isinstance(tree, dict) or tree.get("format") != FORMAT_VERSION:
            return f"{TRAINER_JSON} is not a format-{FORMAT_VERSION} tensor tree"
        unflatten_tree(tree.get("tree"), dict.fromkeys(keys))  # the structure, and every tensor it names exists
    except (OSError, ValueError, SafetensorError) as e:
        return f"unreadable ({str(e).splitlines()[0][:120]})"
    return None


WEIGHT_FILES = ("config.json", "model.safetensors")
"""What a pruned checkpoint leaves under `keep_weights`: a model directory that `model.init` and a teacher read."""


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 3, warn: Callable[[str], None] = print,
                 keep_weights: Path | None = None, weights_kept: int = 0):
        self.root, self.keep_last, self.warn = Path(root), keep_last, warn
        self.keep_weights = keep_weights if weights_kept > 0 else None
        """Where a pruned checkpoint's weights go (RUN_DIR/weights/<its name>/), moved, not copied; None: deleted
        with the rest."""
        self.weights_kept = weights_kept
        """How many of them stay (`checkpoint.keep_weights`, the newest)."""

    # -- writing -------------------------------------------------------------------------------------
    def begin(self, global_step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `global_step`; fill it, then `commit`."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # a write or a prune a kill interrupted
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-step-{global_step:08d}-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, global_step: int, controller: dict, stage_end: dict | None = None,
               known: dict[str, dict] | None = None) -> Path:
        """Write the controller record and the manifest, rename into place, prune. `controller` must be a
        plain record (check_plain); `stage_end` ({stage, type, eval}) marks a stage-end checkpoint; `known`: the
        manifest entries the workers made of their files (model/checkpoint.py `publish_directory`)."""
        check_plain(controller, "controller")
        check_plain(stage_end, "stage_end")
        (tmp / CONTROLLER).write_text(json.dumps({"format": FORMAT_VERSION, **controller}))
        taken = [int(p.name.rsplit("-", 1)[1]) for p in self.root.glob(f"step-{global_step:08d}-*")]
        final = self.root / f"step-{global_step:08d}-{max(taken, default=-1) + 1:03d}"
        manifest = {"format": FORMAT_VERSION, "global_step": global_step, "created_at": time.time(),
                    "rollout_state_format": ROLLOUT_STATE_FORMAT, "stage_end": stage_end}
        publish_directory(tmp, final, manifest, before_manifest=lambda: fault_point("checkpoint_write"), known=known)
        self._prune()
        return final

    def _prune(self) -> None:
        """Delete all but the newest `keep_last`, keeping every stage-end checkpoint. A checkpoint is first
        renamed to `.tmp-*`, so one a kill leaves half-deleted is never mistaken for a checkpoint."""
        for old in self.complete()[: -self.keep_last]:
            if self.stage_end(old) is None:
                trash = self.root / f".tmp-prune-{old.name}-{os.getpid()}"
                os.replace(old, trash)
                if self.keep_weights is not None:
                    self._keep_weights(trash, old.name)
                shutil.rmtree(trash, ignore_errors=True)

    def _keep_weights(self, pruned: Path, name: str) -> None:
        """Move a pruned checkpoint's weight files into keep_weights/<name>/ (renamed into place whole: a kill
        leaves a `.tmp-*` there, never a half directory under the name)."""
        if self.keep_weights.is_symlink() or (self.keep_weights.exists() and not self.keep_weights.is_dir()):
            # never written through a link or over what this manager did not make (issue 40): the weights go
            self.warn(f"{self.keep_weights} is not a directory this run made: the weights of {name} are not kept")
            return
        self.keep_weights.mkdir(parents=True, exist_ok=True)
        for stale in self.keep_weights.glob(".tmp-*"):  # a move or a prune a kill interrupted (one job a run directory)
            shutil.rmtree(stale, ignore_errors=True)
        dest = self.keep_weights / name
        if dest.exists():
            return
        tmp = self.keep_weights / f".tmp-{name}-{os.getpid()}"
        tmp.mkdir()
        for f in WEIGHT_FILES + ((BASE_FILE,) if (pruned / BASE_FILE).is_file() else ()):  # LoRA: the base's identity
            os.replace(pruned / f, tmp / f)
        os.replace(tmp, dest)
        kept = sorted(p for p in self.keep_weights.glob("step-*") if p.is_dir() and not p.is_symlink())
        for old in kept[: -self.weights_kept]:
            trash = self.keep_weights / f".tmp-prune-{old.name}-{os.getpid()}"
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Renamed-into-place checkpoints, oldest first (not yet verified)."""
        # a link is not a checkpoint this manager wrote (configbase/files.py): never read, pruned or followed
        return sorted(p for p in self.root.glob("step-*") if p.is_dir() and not p.is_symlink()) if self.root.is_dir() else []

    @staticmethod
    def problem(path: Path) -> str | None:
        """Why `path` is a damaged checkpoint of this format, or None when it verifies. A checkpoint of
        another format raises CheckpointError (it is refused, not skipped)."""
        try:
            manifest = read_manifest(path)
        except ValueError as e:
            if (path / FORMAT_1_CONTROLLER).exists():
                raise _format_error(path, 1) from None
            return str(e)
        fmt = manifest.get("format")
        if fmt != FORMAT_VERSION:
            if isinstance(fmt, int) and not isinstance(fmt, bool):
                raise _format_error(path, fmt)
            return f"MANIFEST.json has no format number ({fmt!r})"
        if manifest.get("rollout_state_format") != ROLLOUT_STATE_FORMAT:
            raise CheckpointError(f"checkpoint {path} holds in-flight states of layout {manifest.get('rollout_state_format')!r}; "
                                  f"this asyncrl reads layout {ROLLOUT_STATE_FORMAT}: start a new run directory")
        missing = [name for name in REQUIRED if name not in manifest["files"]]
        if missing:
            return f"{missing[0]} is not in the manifest"
        return verify_files(path, manifest) or _unreadable(path)

    def latest(self, stage_end_only: bool = False) -> Path | None:
        """The newest checkpoint that verifies (with `stage_end_only`: the newest stage-end one); damaged
        ones are skipped with a warning; one of another format raises CheckpointError."""
        for path in reversed(self.complete()):
            why = self.problem(path)
            if why is not None:
                self.warn(f"warning: skipping checkpoint {path}: {why}")
            elif not stage_end_only or self.stage_end(path) is not None:
                return path
        return None

    def at_step(self, global_step: int | None) -> Path | None:
        """`latest()`, or with a step the newest checkpoint of that global step that verifies."""
        if global_step is None:
            return self.latest()
        return next((p for p in reversed(self.complete())
                     if p.name.startswith(f"step-{global_step:08d}-") and self.problem(p) is None), None)

    @staticmethod
    def stage_end(path: Path) -> dict | None:
        """{stage, type, eval} of a stage-end checkpoint; None for any other (or an unreadable manifest)."""
        try:
            marker = read_manifest(path).get("stage_end")
        except ValueError:
            return None
        return marker if isinstance(marker, dict) else None

    @staticmethod
    def inflight_files(path: Path) -> list[Path]:
        """The in-flight state files the manifest lists (a file planted beside them is never read)."""
        listed = read_manifest(path)["files"]
        return [Path(path) / n for n in sorted(listed) if n.startswith("inflight-w") and n.endswith(".msgpack")]

    @staticmethod
    def controller_state(path: Path) -> dict:
        """The controller record of a verified checkpoint (without its format number)."""
        try:
            doc = json.loads((Path(path) / CONTROLLER).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: cannot read {CONTROLLER} ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
            raise _format_error(path, doc.get("format") if isinstance(doc, dict) else None)
        return {k: v for k, v in doc.items() if k != "format"}


def find_checkpoint(run_dir: str | Path, step: int | None = None, warn: Callable[[str], None] = print) -> Path:
    """The run's newest verified checkpoint, or the newest verified one of global step `step`; ValueError
    (one line) when there is none."""
    root = Path(run_dir) / "checkpoints"
    try:
        found = CheckpointManager(root, warn=warn).at_step(step)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    if found is None:
        raise ValueError(f"no verified checkpoint{'' if step is None else f' of step {step}'} under {root}")
    return found

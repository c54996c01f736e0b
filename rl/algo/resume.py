"""Checkpoints of a running job and resuming from them (seed §5.1.2 preemptible pools; §5.2.3 in-flight
state persistence). The file format is rl/checkpoint/format.py's; this module decides when a checkpoint is
written, what the driver's record holds, and how a restarted job takes its state back.

Writing: every stage loop asks `wanted()` at its token boundaries; a checkpoint is due every
`checkpoint.every_steps` train steps, at every stage end, and on SIGTERM/SIGINT (the `PreemptionGuard`),
after which `save` raises `Preempted` and the job exits 0.

Resuming (`find_resume_point`): the newest valid checkpoint; a recipe that changes what the checkpoint
depends on is refused with one line; the store is rolled back to the checkpoint's watermark (rl/store/trajectories.py)
so work done after it is redone with the same ids. Every committed checkpoint leaves a lineage token in run.json and
the store (`record_lineage`): a resume from a copy of the run directory that fell behind (the store's newest token is
not the directory's) is refused with one line instead of rolling the run back, or with `new_identity` becomes a new
run whose rows up to its checkpoint are copied (rl/store/identity.py). Each stage loop takes its state back once, with
`restore_stage` (weights, optimizer, RNG; the loop's record) and `restore_inflight` (in-flight samples).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rl.checkpoint.format import CheckpointError, CheckpointManager
from rl.algo.records import controller_from_record, controller_to_record
from rl.config import Recipe
from rl.checkpoint.preempt import Preempted, PreemptionGuard
from rl.recipe_io import recipe_from_yaml, recipe_to_yaml
from rl.metrics import MetricsLogger
from rl.runtime.groups import PolicyGroup
from rl.store.identity import add_checkpoint_token, checkpoint_tokens, fork_identity
from rl.store.trajectories import TrajectoryStore, Watermark

INCOMPATIBLE = ("model", "tokenizer", "datasets", "effort")
"""Recipe sections a resume may not change (the checkpoint's weights and streams depend on them)."""


def check_resumable(saved: Recipe, recipe: Recipe) -> None:
    """Refuse a resume whose recipe changes what the checkpoint depends on; logging, budgets, learning
    rates, evaluation, placement and checkpoint cadence may change."""
    old, new = saved.model_dump(mode="json"), recipe.model_dump(mode="json")
    for key in INCOMPATIBLE:
        if old[key] != new[key]:
            raise CheckpointError(f"cannot resume: the recipe changes {key} ({_first_diff(old[key], new[key], key)}); "
                                  f"start a new run directory instead")
    kinds = [s["type"] for s in old["stages"]], [s["type"] for s in new["stages"]]
    if kinds[0] != kinds[1]:
        raise CheckpointError(f"cannot resume: the stages change from {kinds[0]} to {kinds[1]}")
    for i, (a, b) in enumerate(zip(saved.stages, recipe.stages)):  # a stage's streams and groups are per dataset
        if saved.stage_datasets(a) != recipe.stage_datasets(b):
            raise CheckpointError(f"cannot resume: the recipe changes stages.{i}.datasets ({saved.stage_datasets(a)} -> "
                                  f"{recipe.stage_datasets(b)}); start a new run directory instead")


def _first_diff(a, b, path: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_diff(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_diff(x, y, f"{path}.{i}")
    return f"{path}: {a!r} -> {b!r}"


@dataclass
class ResumePoint:
    """The checkpoint a restarted job continues from, and its driver record."""

    path: Path
    stage_idx: int
    global_step: int
    stage_minutes: float
    summary: dict[str, float]


def record_lineage(run_dir: Path, store: TrajectoryStore, path: Path, global_step: int) -> None:
    """After a checkpoint is committed: a fresh token into run.json, then into the store. A kill between the two
    leaves the store's newest token one that run.json still holds (it keeps the last few)."""
    token = uuid.uuid4().hex
    add_checkpoint_token(run_dir, token)
    store.record_checkpoint(token, path.name, global_step)


def check_lineage(run_dir: Path, store: TrajectoryStore, newest: Path | None) -> None:
    """Refuse (CheckpointError, one line) a resume from a copy of the run directory that fell behind: the store's
    newest checkpoint row for this run carries a token this directory's run.json never held, so another copy wrote
    it and the store holds that copy's later work, which a rollback to this directory's checkpoint would delete."""
    found = store.newest_checkpoint()
    if found is None or found["token"] in checkpoint_tokens(run_dir):
        return
    steps = store.last_train_step()
    raise CheckpointError(
        f"the store already holds run {store.run_id} up to train step {max(steps or 0, found['train_step'])}, "
        f"checkpointed at step {found['train_step']} ({found['checkpoint']}) by another copy of this run directory; "
        f"{run_dir}'s newest checkpoint is " + (newest.name if newest is not None else "none")
        + ": resuming it would roll that run back. Resume this copy as a run of its own: "
        f"rl resume {run_dir} --new-identity")


def check_lora_base(recipe: Recipe, path: Path) -> None:
    """Refuse (CheckpointError, one line) before anything is rolled back: a checkpoint of LoRA adapters alone whose
    base (model/checkpoint.py `BASE_FILE`) is not the recipe's base file, byte for byte (sha256)."""
    from model.checkpoint import base_record, check_base
    from model.formats import CheckpointFormatError
    from rl.runtime.worker import initial_weights

    record = base_record(path)
    base = initial_weights(recipe) if recipe.model.lora is not None else None
    if record is None:
        return
    if base is None:
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters alone, on the base {record['path']}; the recipe "
                              "has no model.lora or no base file to put them on")
    try:
        check_base(path, record, against=base)
    except CheckpointFormatError as e:
        raise CheckpointError(f"cannot resume: {e}") from None


def find_resume_point(recipe: Recipe, store: TrajectoryStore, manager: CheckpointManager,
                      say: Callable[[str], None], *, run_dir: Path | None = None,
                      new_identity: bool = False) -> ResumePoint | None:
    """The newest valid checkpoint, with the store rolled back to it; None (store emptied) when the run
    never wrote one. Raises CheckpointError when checkpoints exist but none is usable, the recipe
    changes what they depend on (starting over would roll the store back over the whole run), or the run directory
    (default: the checkpoints' parent) is a copy that fell behind the store (`check_lineage`). `new_identity`: resume
    as a new run instead, forked from this one at the checkpoint (rl/store/trajectories.py `fork`)."""
    run_dir = manager.root.parent if run_dir is None else Path(run_dir)
    path = manager.latest()  # a checkpoint of another format raises: refused, never skipped
    if not new_identity:
        check_lineage(run_dir, store, path)
    if path is None:
        if manager.complete():
            raise CheckpointError(f"none of the {len(manager.complete())} checkpoints under {manager.root} is usable (see "
                                  f"the warnings); refusing to start the run over: restore one, or start a new run directory")
        # A crash before the first periodic checkpoint leaves at most every_steps recorded steps: those
        # are redone. More than that means checkpoints existed and are gone: never start over silently.
        if not new_identity and (trained := store.count_train_steps()) > recipe.checkpoint.every_steps:
            raise CheckpointError(f"the run has {trained} recorded train steps but no checkpoint under {manager.root}; "
                                  "refusing to start it over (that rolls its store back over them): restore a "
                                  "checkpoint, or start a new run directory (or rl train --overwrite)")
        if new_identity:  # a new run from the start: nothing of the old one is copied or rolled back
            _fork(run_dir, store, Watermark(0, 0), say)
        say(f"resume: no complete checkpoint under {manager.root}; starting from the beginning")
        store.rollback_to(Watermark(0, 0), checkpoint="")
        return None
    try:
        state = controller_from_record(CheckpointManager.controller_state(path))
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    check_resumable(recipe_from_yaml(state["recipe_yaml"]), recipe)
    check_lora_base(recipe, path)
    if new_identity:
        _fork(run_dir, store, state["watermark"], say)
    undone = store.rollback_to(state["watermark"], checkpoint=str(path))
    say(f"resume: {path.name} (stage {state['stage_idx']}, train step {state['global_step']}); store rolled back: "
        + ", ".join(f"{k}={v}" for k, v in undone.items()))
    return ResumePoint(path, state["stage_idx"], state["global_step"], state["stage_minutes"], dict(state["summary"]))


def _fork(run_dir: Path, store: TrajectoryStore, wm: Watermark, say: Callable[[str], None]) -> None:
    """The run directory becomes a new run: its rows up to `wm` copied under a new id (one transaction), then the
    id in run.json. A kill between the two leaves the copied rows unreferenced, the directory the old run's copy."""
    old = store.run_id
    new = str(uuid.uuid4())
    copied = store.fork(new, wm)
    fork_identity(run_dir, new, wm.train_step)
    say(f"resume: new identity {new} for this copy of run {old} (forked at train step {wm.train_step}: "
        f"{copied['samples']} samples and {copied['train_steps']} train steps copied)")


@dataclass
class RunState:
    """What the stages of one job share, and a checkpoint keeps."""

    global_step: int = 0
    """Optimizer steps over all stages so far; the policy version is this number."""
    summary: dict[str, float] = field(default_factory=dict)
    """Held-out accuracy after each finished stage (the RESULT line)."""
    first_stage: int = 0
    """The stage a resumed job re-enters."""
    stage_minutes_before: float = 0.0
    """Minutes the current stage ran before the checkpoint this job resumed from."""
    stage_t0: float = 0.0
    """When the current stage (re)started, monotonic seconds."""


class Checkpointed(Protocol):
    """What a checkpoint reads of a running job, and what a resume hands its state back to (rl/algo/job.py `Job`)."""

    @property
    def run_dir(self) -> Path: ...
    @property
    def recipe(self) -> Recipe: ...
    @property
    def state(self) -> RunState: ...
    @property
    def store(self) -> TrajectoryStore: ...
    @property
    def logger(self) -> MetricsLogger: ...
    @property
    def policy(self) -> PolicyGroup: ...

class Checkpointer:
    """When to write a checkpoint, writing it, and handing a resumed job its state back. Without a
    manager (a test or bench driving one stage) nothing is written or restored."""

    def __init__(self, manager: CheckpointManager | None, every_steps: int = 0, resume_from: ResumePoint | None = None,
                 background: bool = False):
        self.manager, self.every_steps, self.resume_from = manager, every_steps, resume_from
        self.background = background
        self.guard: PreemptionGuard | None = None
        self.last_step = resume_from.global_step if resume_from else -1
        self.pending: tuple[Path, int, dict, float] | None = None  # a background write: (tmp, step, record, t0)

    def wanted(self, global_step: int) -> bool:
        """A checkpoint is due here: every `every_steps` train steps (once per step), or after a signal."""
        if self.manager is None:
            return False
        due = (self.every_steps > 0 and global_step > 0 and global_step % self.every_steps == 0
               and global_step != self.last_step)
        return due or (self.guard is not None and self.guard.requested)

    def save(self, job: Checkpointed, stage_idx: int, stage_record: dict, stage_end: dict | None = None) -> Path | None:
        """Write a resumable checkpoint; call with every engine interrupted and rewards collected.
        `stage_end`: the stage-end marker (stage, type, held-out metrics). After a preemption request,
        raises `Preempted` once it is written. A periodic one is written in the background (`background`):
        returns None then; `poll` or the next `save` commits it."""
        if self.manager is None:
            return None
        self.finish(job)
        state = job.state
        preempting = self.guard is not None and self.guard.requested
        background = self.background and stage_end is None and not preempting
        tmp = self.manager.begin(state.global_step)
        driver = {"stage_idx": stage_idx, "stage_type": job.recipe.stages[stage_idx].type, "global_step": state.global_step,
                  "stage_minutes": state.stage_minutes_before + (time.monotonic() - state.stage_t0) / 60,
                  "watermark": job.store.watermark(state.global_step), "summary": dict(state.summary),
                  "recipe_yaml": recipe_to_yaml(job.recipe), "num_workers": len(job.policy), "stage_end": stage_end}
        record = controller_to_record(driver, stage_record)
        t0 = time.monotonic()
        with self._write_errors(tmp, state.global_step):
            reports = job.policy.save(str(tmp), background)
        self.last_step = state.global_step
        # what the workers' part of the pause went to (the slowest worker's), and the in-flight bytes written
        job.logger.log({**{f"checkpoint/{k}": max(r[k] for r in reports) for k in reports[0] if k.endswith("_s")},
                        "checkpoint/inflight_bytes": sum(r["inflight_bytes"] for r in reports)}, step=state.global_step)
        if background:
            self.pending = (tmp, state.global_step, record, t0)
            return None
        with self._write_errors(tmp, state.global_step):
            path = self.manager.commit(tmp, state.global_step, record, stage_end=stage_end)
        record_lineage(job.run_dir, job.store, path, state.global_step)
        job.logger.log({"checkpoint/global_step": state.global_step}, step=state.global_step)
        if preempting:
            raise Preempted(str(path))
        return path

    def poll(self, job: Checkpointed) -> None:
        """Commit a background checkpoint whose files are all written (cheap to call once per train step)."""
        if self.pending is not None and job.policy.saves_done():
            self.finish(job)

    def finish(self, job: Checkpointed) -> Path | None:
        """Wait for the background checkpoint's files and commit it (nothing pending: None)."""
        if self.pending is None:
            return None
        tmp, step, record, t0 = self.pending
        self.pending = None
        with self._write_errors(tmp, step):
            path = self.manager.commit(tmp, step, record, known=job.policy.wait_saved())
        record_lineage(job.run_dir, job.store, path, step)
        job.logger.log({"checkpoint/global_step": step, "checkpoint/background_s": time.monotonic() - t0},
                       step=job.state.global_step)
        return path

    @contextmanager
    def _write_errors(self, tmp: Path, global_step: int):
        """A full disk, a quota (a Ray worker's error too): stop with the previous checkpoint intact, in one line."""
        try:
            yield
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            cause = getattr(e, "cause", None) or e
            last = self.manager.latest()
            raise CheckpointError(
                f"the checkpoint of train step {global_step} could not be written ({type(cause).__name__}: "
                f"{str(cause).splitlines()[0]}); stopping. The run resumes from "
                + (f"{last.name}" if last is not None else "its start") + " once the disk has room") from None

    def restore_stage(self, job: Checkpointed) -> dict | None:
        """At a stage's start, once after a resume: the checkpoint's weights, optimizer and RNG go to the
        workers; returns the stage loop's record (None when there is nothing to restore)."""
        if self.resume_from is None:
            return None
        job.policy.load(str(self.resume_from.path))
        job.policy.update_weights(job.state.global_step)
        return controller_from_record(CheckpointManager.controller_state(self.resume_from.path))["stage_state"]

    def restore_inflight(self, job: Checkpointed) -> list[list[str]]:
        """The checkpoint's in-flight states to the workers (parked; `resume` continues them); returns each
        worker's sample ids. Ends the restore: later stages start fresh."""
        files = [str(p) for p in CheckpointManager.inflight_files(self.resume_from.path)]
        ids = job.policy.load_inflight(files)
        self.resume_from = None
        return ids

    def restored(self) -> None:
        """The stage loop has taken its state (stages without in-flight samples)."""
        self.resume_from = None

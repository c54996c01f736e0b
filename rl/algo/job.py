"""A running job: the components every stage runner drives (typed, built once by `open_job`), the small
state the stages share (`RunState`), and what follows every optimizer step (`Job.finish_train_step`).

    with open_job(recipe, run_dir, resume=True) as job:      # store, metrics, workers, checkpoints
        run_sft(job, stage, 0)                               # or run_async_grpo(job, stage, 1), ...

The job holds no model: the PolicyWorkers do. Stage runners (rl/algo/driver.py `run_sft`, rl/algo/async_grpo.py
`run_async_grpo`) take a `Job`; tests and benches open one the same way `rl train` does.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from configbase.files import atomic_write
from rewards.task import Task
from rl.algo import evaluation
from rl.checkpoint.format import CheckpointManager
from rl.config import GRPOStage, Recipe, SFTStage
from rl.metrics import MetricsLogger
from rl.recipe_io import recipe_to_yaml
from rl.algo.prompt_lengths import check_prompt_lengths
from rl.algo.rendering import Renderer
from rl.algo.resume import Checkpointer, RunState, find_resume_point
from rl.checkpoint.run_dir import RUN_ARTIFACTS, RunLock, check_run_entries, claim_for_new_run, make_run_dir
from rl.runtime.groups import PolicyGroup, RewardGroup, Runtime
from rl.store.trajectories import TrajectoryStore


class Progress:
    """The console side of a job: a progress bar per stage, and after a resume the time to the first new
    token (`resume/first_token_s`, seconds since the process started).

    The bar tells the truth about the budget that binds: it starts at the step a resumed stage continues
    from, and when the stage has a wall-clock budget its total is the number of steps that budget will
    allow at the rate so far (never more than max_steps), so its ETA is the stage's real end."""

    def __init__(self, enabled: bool, say: Callable[[str], None], logger: MetricsLogger, t_start: float, file=None):
        self.enabled, self.say, self.logger, self.t_start, self.file = enabled, say, logger, t_start, file
        self.bar: tqdm | None = None
        self.first_token_pending = False
        self._max_steps, self._deadline, self._start, self._t_first = 0, None, 0, 0.0

    def start_stage(self, stage_idx: int, stage: SFTStage | GRPOStage) -> None:
        self.bar = tqdm(total=stage.max_steps, desc=f"stage {stage_idx} {stage.type}", dynamic_ncols=True,
                        disable=not self.enabled, file=self.file)
        self._max_steps, self._deadline, self._start = stage.max_steps, None, 0

    def begin_steps(self, start: int, deadline: float | None) -> None:
        """The stage's steps run from `start` (a resume's step) until max_steps or `deadline` (monotonic)."""
        self._start, self._deadline, self._t_first = start, deadline, time.monotonic()
        if self.bar is not None and start:
            self.bar.n = self.bar.last_print_n = start
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def step(self, metrics: Mapping[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if self._deadline is not None and self.bar.n > self._start:
                now = time.monotonic()
                rate = (self.bar.n - self._start) / max(now - self._t_first, 1e-9)
                projected = self.bar.n + rate * max(self._deadline - now, 0.0)
                self.bar.total = max(self.bar.n, min(self._max_steps, math.ceil(projected)))
            shown = {"loss": "sft/loss", "reward": "rollout/reward", "len": "rollout/response_len", "tok_s": "rollout/tokens_per_s"}
            self.bar.set_postfix({k: f"{metrics[m]:.3g}" for k, m in shown.items() if m in metrics})

    def generated(self, tokens: int, global_step: int) -> None:
        if self.first_token_pending and tokens:
            self.first_token_pending = False
            seconds = time.monotonic() - self.t_start
            self.say(f"resume: first new token {seconds:.2f} s after start")
            self.logger.log({"resume/first_token_s": seconds}, step=global_step)


@dataclass
class StageResult:
    """What a stage runner returns: the held-out metrics at its end, and (asynchronous stages) the
    rollout clock."""

    eval: dict[str, float]
    clock: object | None = None


@dataclass(eq=False)
class Job:
    recipe: Recipe
    run_dir: Path
    policy: PolicyGroup
    rewards: RewardGroup
    store: TrajectoryStore
    logger: MetricsLogger
    renderer: Renderer
    checkpointer: Checkpointer
    progress: Progress
    state: RunState = field(default_factory=RunState)
    say: Callable[[str], None] = print

    @property
    def tasks(self) -> Mapping[str, Task]:
        return self.renderer.tasks

    def stage_tasks(self, stage: SFTStage | GRPOStage) -> dict[str, Task]:
        """The tasks a stage draws its prompts from (`stages[i].datasets`, default all)."""
        return {d: self.tasks[d] for d in self.recipe.stage_datasets(stage)}

    def deadline(self, stage: SFTStage | GRPOStage) -> float | None:
        """The `time.monotonic()` at which the stage's wall-clock budget ends (the minutes spent before a resume
        counted); None without a budget."""
        s = self.state
        return None if stage.max_minutes is None else s.stage_t0 + 60.0 * (stage.max_minutes - s.stage_minutes_before)

    def budget(self, stage: SFTStage | GRPOStage, start: int = 0) -> Iterator[int]:
        """Step indices start..max_steps-1 while the stage's wall-clock budget (counting the minutes
        spent before a resume) lasts."""
        deadline = self.deadline(stage)
        self.progress.begin_steps(start, deadline)
        for step in range(start, stage.max_steps):
            if deadline is not None and time.monotonic() >= deadline:
                return
            yield step

    def evaluate(self, effort: int | None = None) -> dict[str, float]:
        """Held-out accuracy and lengths per dataset on the workers (rl/algo/evaluation.py; greedy unless
        eval.temperature > 0). With effort conditioning the prompts carry the effort prefix (default: the
        highest level)."""
        if effort is None and self.recipe.effort is not None:
            effort = self.recipe.effort.levels[-1]
        cfg = self.recipe.eval
        tasks = {d: self.tasks[d] for d in self.recipe.eval_datasets()}
        return evaluation.evaluate(self.policy.generate, self.renderer, tasks, max_new_tokens=self.recipe.max_response_tokens,
                                   temperature=cfg.temperature, max_problems=cfg.max_problems, effort=effort)

    def advance_version(self) -> int:
        """After an optimizer step: the policy version (= the global step) advances on every worker; new
        tokens carry it. Returns it."""
        self.state.global_step += 1
        self.policy.update_weights(self.state.global_step)
        return self.state.global_step

    def record_train_step(self, stage: SFTStage | GRPOStage, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics: GRPO/OPD steps go to the store (with a held-out evaluation every
        `eval_every`), every `log_every`-th step to the metrics sinks."""
        if isinstance(stage, GRPOStage):
            if stage.eval_every and (step + 1) % stage.eval_every == 0:
                metrics.update(self.evaluate())
            self.store.add_train_step(self.state.global_step, metrics)
        self.progress.step(metrics)
        if step % stage.log_every == 0:
            self.logger.log(metrics, step=self.state.global_step)

    def stage_end_checkpoint(self, stage_idx: int, stage_record: dict) -> dict[str, float]:
        """Evaluate the stage that just ended and write its stage-end checkpoint, which carries the
        metrics; returns them."""
        metrics = self.evaluate()
        marker = {"stage": stage_idx, "type": self.recipe.stages[stage_idx].type, "eval": metrics}
        path = self.checkpointer.save(self, stage_idx, stage_record, stage_end=marker)
        if path is not None and self.recipe.model.init is not None:  # a real model: a Hugging Face copy too
            from rl.checkpoint.export import stage_end_export  # heavy (torch, safetensors) and only needed here

            self.say(f"exported stage {stage_idx} to {stage_end_export(self.recipe, path, self.run_dir)}")
        return metrics


@contextmanager
def open_job(recipe: Recipe, run_dir: Path, *, say: Callable[[str], None] = print, resume: bool = False,
             checkpoints: bool = True, overwrite: bool = False, break_lock: bool = False,
             new_identity: bool = False) -> Iterator[Job]:
    """The job of `recipe` in `run_dir`: its datasets scanned (`Task.scan`: a bad row raises a DatasetError
    before anything starts) and their prompt lengths checked (rl/algo/prompt_lengths.py), its store (upgraded under
    its lock; run identity in run.json), its newest valid checkpoint when resuming (the store rolled back to it),
    metrics sinks and workers; all of it closed on exit. `checkpoints=False`: no checkpoint is written (a bench driving one stage). The job holds
    the run directory's lock throughout (rl/checkpoint/run_dir.py); a fresh job refuses a directory that holds a run
    unless `overwrite`."""
    t_start = time.monotonic()
    tasks = {d.name: d.build() for d in recipe.datasets}
    for task in tasks.values():  # every row of every dataset file, before the run directory, the store or any worker
        note = task.scan() if callable(getattr(task, "scan", None)) else None
        if note:
            say(note)
    renderer = Renderer.for_recipe(recipe, tasks)
    check_prompt_lengths(renderer, tasks, recipe.engine.overlong_prompts, recipe.effort.levels if recipe.effort else (), say)
    make_run_dir(run_dir)
    lock = RunLock(run_dir, break_lock=break_lock).acquire()
    begun: list[str] = []  # a fresh run's artifacts not there before it: undone when the start fails
    try:
        if not resume:
            claim_for_new_run(run_dir, overwrite=overwrite, say=say)
            begun = [n for n in RUN_ARTIFACTS if not os.path.lexists(run_dir / n)]
        check_run_entries(run_dir)  # no link at a name the run writes (configbase/files.py: never followed)
        store = TrajectoryStore.for_run_dir(run_dir, url=recipe.store.url, name=recipe.run.name)
    except BaseException:
        _undo_start(run_dir, begun)
        lock.release()
        raise
    recipe_yaml = recipe_to_yaml(recipe)
    runtime = logger = None
    started = False
    try:
        manager = CheckpointManager(run_dir / "checkpoints", keep_last=recipe.checkpoint.keep_last, warn=say,
                                    keep_weights=run_dir / "weights", weights_kept=recipe.checkpoint.keep_weights) \
            if checkpoints else None
        resume_from = find_resume_point(recipe, store, manager, say, run_dir=run_dir,  # new_identity: rl/algo/resume.py
                                        new_identity=new_identity) if resume and manager else None
        atomic_write(run_dir / "recipe.yaml", recipe_yaml)  # never through a planted link (configbase/files.py)
        store.add_run(recipe.run.name, recipe_yaml)
        logger = MetricsLogger(run_dir, recipe.logging, run_name=recipe.run.name, config=recipe.model_dump(mode="json"))
        for note in logger.notes:
            say(note)
        runtime = Runtime(recipe, run_dir, say=say)
        state = RunState()
        progress = Progress(recipe.logging.progress_bar, say, logger, t_start)
        if resume_from is not None:
            state = RunState(resume_from.global_step, dict(resume_from.summary), resume_from.stage_idx, resume_from.stage_minutes)
            progress.first_token_pending = True
        started = True
        yield Job(recipe, run_dir, runtime.policy, runtime.rewards, store, logger, renderer,
                  Checkpointer(manager, recipe.checkpoint.every_steps, resume_from, recipe.checkpoint.background), progress, state, say)
    finally:
        if runtime is not None:
            runtime.shutdown()
        if logger is not None:
            logger.close()
        store.close()
        if not started:
            _undo_start(run_dir, begun)
        lock.release()


def _undo_start(run_dir: Path, begun: list[str]) -> None:
    """A fresh job that fails before it is open (workers, KV pool, placement, Ctrl-C) removes the artifacts it had begun
    (`begun`: RUN_ARTIFACTS names absent before, under its lock), so that the same command starts again rather than
    refusing a directory that "holds a run" which never ran a step. Nothing that was there before is touched."""
    for name in begun:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            p.unlink(missing_ok=True)

"""The training driver: run a recipe's stages in order on the runtime (Ray or in-process).

Stages:
- `sft`: teacher forcing on demonstrations drawn from each dataset's train stream (demonstrations
  may contain the demonstrator's slips; see rewards/arithmetic.py), data-parallel over the workers.
- `grpo`: asynchronous GRPO with sample-level dispatch, token-level interruption and state reuse
  across weight updates (rl/async_grpo.py); the `sync` dispatch policy is the no-overlap baseline.

At the end of every stage the driver evaluates greedy held-out accuracy and writes a stage-end
checkpoint that carries it; at the end it returns the summary that `rl train` prints as
`RESULT <stage>_acc=... minutes=...`.

Preemption and resume (rl/checkpoint.py, rl/preempt.py): every stage loop calls
`checkpoint_wanted()` at its token boundaries; a resumable checkpoint is written every
`checkpoint.every_steps` train steps and on SIGTERM/SIGINT (then the job exits 0). `train(...,
resume=True)` restores the newest valid checkpoint, rolls the store back to its watermark and re-enters
the stage loop where it stopped; in-flight samples continue from their exact token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from rewards.task import Task
from rl import evaluation
from rl.async_grpo import run_async_grpo
from rl.checkpoint import CheckpointError, CheckpointManager
from rl.ckpt_records import controller_from_record, controller_to_record
from rl.config import GRPOStage, Recipe, SFTStage
from rl.metrics import MetricsLogger
from rl.preempt import Preempted, PreemptionGuard
from rl.recipe_io import recipe_to_yaml
from rl.rendering import Renderer
from rl.runtime import Runtime
from rl.store import TrajectoryStore, Watermark
from rl.sft import DemonstrationStream
from rl.trainer import merge_step_metrics


@dataclass
class RunContext:
    """What every stage needs; built once by `train`. Holds no model: the workers do."""

    recipe: Recipe
    run_dir: Path
    runtime: Runtime
    tasks: dict[str, Task]
    store: TrajectoryStore
    logger: MetricsLogger
    say: Callable[[str], None]
    renderer: Renderer
    ckpt: CheckpointManager | None = None
    guard: PreemptionGuard | None = None
    global_step: int = 0
    bar: tqdm | None = None
    stage_minutes_before: float = 0.0
    """Minutes the current stage ran before the checkpoint this job resumed from."""
    stage_t0: float = 0.0
    last_ckpt_step: int = -1
    restore_from: Path | None = None
    """The checkpoint being resumed (cleared once the stage loop has taken its state)."""
    summary: dict = None  # stage accuracies so far (kept across resumes)
    t_start: float = 0.0
    first_token_pending: bool = False
    """Set on resume: the first generated token is reported as `resume/first_token_s` (since start)."""
    stage_eval: dict | None = None
    """Held-out metrics of the stage that just ended (taken for its stage-end checkpoint)."""

    def generated(self, tokens: int) -> None:
        if self.first_token_pending and tokens:
            self.first_token_pending = False
            seconds = time.monotonic() - self.t_start
            self.say(f"resume: first new token {seconds:.2f} s after start")
            self.logger.log({"resume/first_token_s": seconds}, step=self.global_step)

    def budget(self, stage: SFTStage | GRPOStage, start: int = 0) -> Iterator[int]:
        """Step indices start..max_steps-1 while the stage's wall-clock budget (counting the minutes
        spent before a resume) lasts."""
        deadline = None if stage.max_minutes is None else (
            self.stage_t0 + 60.0 * (stage.max_minutes - self.stage_minutes_before))
        for step in range(start, stage.max_steps):
            if deadline is not None and time.monotonic() >= deadline:
                return
            yield step

    # -- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_wanted(self) -> bool:
        every = self.recipe.checkpoint.every_steps
        due = every > 0 and self.global_step > 0 and self.global_step % every == 0 and self.global_step != self.last_ckpt_step
        return due or (self.guard is not None and self.guard.requested)

    def save_checkpoint(self, stage_idx: int, stage_state: dict, stage_end: bool = False) -> Path | None:
        """Write a resumable checkpoint; call with every engine interrupted and rewards collected. At a
        stage end the stage is evaluated first (metrics kept in `stage_eval`) and the checkpoint is marked
        with them. After a preemption request, raises `Preempted` once it is written. Without a manager
        nothing is written."""
        stage_type, marker = self.recipe.stages[stage_idx].type, None
        if stage_end:
            self.stage_eval = evaluate(self)
            marker = {"stage": stage_idx, "type": stage_type, "eval": self.stage_eval}
        if self.ckpt is None:
            return None
        tmp = self.ckpt.begin(self.global_step)
        self.runtime.policy.call_all("save_state", str(tmp))
        driver = {"stage_idx": stage_idx, "stage_type": stage_type, "global_step": self.global_step,
                  "stage_minutes": self.stage_minutes_before + (time.monotonic() - self.stage_t0) / 60,
                  "watermark": self.store.watermark(self.global_step), "summary": dict(self.summary),
                  "recipe_yaml": recipe_to_yaml(self.recipe), "num_workers": len(self.runtime.policy), "stage_end": marker}
        path = self.ckpt.commit(tmp, self.global_step, controller_to_record(driver, stage_state), stage_end=marker)
        self.last_ckpt_step = self.global_step
        self.logger.log({"checkpoint/global_step": self.global_step}, step=self.global_step)
        if self.guard is not None and self.guard.requested:
            raise Preempted(str(path))
        return path

    def restore_inflight(self) -> list[list[str]]:
        """Hand the restored checkpoint's in-flight states to the workers (parked; `resume` continues
        them); returns each worker's sample ids."""
        files = [str(p) for p in CheckpointManager.inflight_files(self.restore_from)]
        return self.runtime.policy.call_all("load_inflight", files)

    def restore_stage(self, stage: SFTStage | GRPOStage) -> dict | None:
        """At a stage's start: load the checkpoint's weights/optimizer/RNG; returns the loop state."""
        if self.restore_from is None:
            return None
        self.runtime.policy.call_all("load_state", str(self.restore_from))
        self.runtime.policy.call_all("set_version", self.global_step)
        return controller_from_record(CheckpointManager.controller_state(self.restore_from))["stage_state"]

    def after_train_step(self, stage: SFTStage | GRPOStage, step: int, metrics: dict) -> None:
        if isinstance(stage, GRPOStage):
            if stage.eval_every and (step + 1) % stage.eval_every == 0:
                metrics.update(evaluate(self))
            self.store.add_train_step(self.global_step, metrics)
        if self.bar is not None:
            self.bar.update(1)
        if step % stage.log_every == 0:
            self.logger.log(metrics, step=self.global_step)
            if self.bar is not None:
                shown = {"loss": "sft/loss", "reward": "rollout/reward", "len": "rollout/response_len", "tok_s": "rollout/tokens_per_s"}
                self.bar.set_postfix({k: f"{metrics[m]:.3g}" for k, m in shown.items() if m in metrics})


def make_context(recipe: Recipe, run_dir: Path, runtime: Runtime, store: TrajectoryStore, logger: MetricsLogger,
                 say: Callable[[str], None] = print, **kw) -> RunContext:
    """A RunContext with the recipe's tasks and renderer (tests and benches drive single stages with it)."""
    tasks = {d.name: d.build() for d in recipe.datasets}
    renderer = Renderer(recipe.tokenizer.build(), tasks, recipe.effort, recipe.run.seed)
    return RunContext(recipe=recipe, run_dir=run_dir, runtime=runtime, tasks=tasks, store=store, logger=logger, say=say,
                      renderer=renderer, **kw)


def _split(items: list, n: int) -> list[list]:
    return [items[i::n] for i in range(n)]


def evaluate(ctx: RunContext, effort: int | None = None) -> dict[str, float]:
    """Held-out accuracy and lengths per dataset on the workers (rl/evaluation.py; greedy unless
    eval.temperature > 0). With effort conditioning the prompts carry the effort prefix (default: the
    highest level)."""
    policy = ctx.runtime.policy
    if effort is None and ctx.recipe.effort is not None:
        effort = ctx.recipe.effort.levels[-1]

    def generate(reqs):
        gens = {g.sample_id: g for part in policy.get([policy.submit(w, "generate", chunk)
                                                        for w, chunk in enumerate(_split(list(reqs), len(policy)))]) for g in part}
        return [gens[r.sample_id] for r in reqs]

    cfg = ctx.recipe.eval
    return evaluation.evaluate(generate, ctx.renderer, ctx.tasks, max_new_tokens=ctx.recipe.engine.max_new_tokens,
                               temperature=cfg.temperature, max_problems=cfg.max_problems, effort=effort)


def run_sft(ctx: RunContext, stage: SFTStage, stage_idx: int) -> None:
    policy = ctx.runtime.policy
    policy.call_all("begin_stage", stage)
    demos = DemonstrationStream(ctx.tasks, ctx.renderer, stage, seed_offset=1000 + stage_idx,
                                rng_seed=f"sft:{ctx.recipe.run.seed}:{stage_idx}")
    start = 0
    restored = ctx.restore_stage(stage)
    if restored is not None:
        start = restored["step"]
        demos.load_state_dict({"drawn": restored["drawn"], "rng": restored["rng"]})
        ctx.restore_from = None

    def checkpoint(step: int, stage_end: bool = False) -> None:
        ctx.save_checkpoint(stage_idx, {"step": step, **demos.state_dict()}, stage_end=stage_end)

    step = start - 1
    for step in ctx.budget(stage, start):
        if ctx.checkpoint_wanted():
            checkpoint(step)
        batch = demos.next_batch(stage.batch_size)
        n = len(policy)  # data parallel: rows i, i + n, ... to worker i, every loss ÷ the whole batch's tokens
        metrics = merge_step_metrics(policy.get([policy.submit(w, "train_step", batch.select(range(w, len(batch), n)), stage)
                                                 for w in range(n)]))
        ctx.global_step += 1
        policy.call_all("set_version", ctx.global_step)
        ctx.after_train_step(stage, step, metrics)
    checkpoint(step + 1, stage_end=True)  # a resume with a larger budget continues from here


STAGE_RUNNERS = {"sft": run_sft, "grpo": run_async_grpo, "opd": run_async_grpo}


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


def _find_resume_point(recipe: Recipe, store: TrajectoryStore, ckpt: CheckpointManager,
                       say: Callable[[str], None]) -> tuple[Path | None, dict | None]:
    path = ckpt.latest()  # a checkpoint of another format raises: refused, never skipped
    if path is None:
        if ckpt.complete():  # starting over would roll the store back over the whole run
            raise CheckpointError(f"none of the {len(ckpt.complete())} checkpoints under {ckpt.root} is usable (see the "
                                  f"warnings); refusing to start the run over: restore one, or start a new run directory")
        say(f"resume: no complete checkpoint under {ckpt.root}; starting from the beginning")
        store.rollback_to(Watermark(0, 0), checkpoint="")
        return None, None
    try:
        state = controller_from_record(CheckpointManager.controller_state(path))
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    from rl.recipe_io import recipe_from_yaml

    check_resumable(recipe_from_yaml(state["recipe_yaml"]), recipe)
    undone = store.rollback_to(state["watermark"], checkpoint=str(path))
    say(f"resume: {path.name} (stage {state['stage_idx']}, train step {state['global_step']}); store rolled back: "
        + ", ".join(f"{k}={v}" for k, v in undone.items()))
    return path, state


def train(recipe: Recipe, run_dir: Path, say: Callable[[str], None] = print, resume: bool = False) -> dict[str, float]:
    """Run every stage of the recipe (from the run's newest valid checkpoint when `resume`); returns
    the summary that the RESULT line prints. A SIGTERM/SIGINT ends it early with `preempted=1`."""
    t_start = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_yaml = recipe_to_yaml(recipe)
    # Upgrades the store under its lock; the run id is RUN_DIR/run.json's (created on the first start).
    store = TrajectoryStore.for_run_dir(run_dir, url=recipe.store.url, name=recipe.run.name)
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=recipe.checkpoint.keep_last, warn=say)
    restore_from, state = _find_resume_point(recipe, store, ckpt, say) if resume else (None, None)
    (run_dir / "recipe.yaml").write_text(recipe_yaml)
    store.add_run(recipe.run.name, recipe_yaml)
    logger = MetricsLogger(run_dir, recipe.logging, run_name=recipe.run.name, config=recipe.model_dump(mode="json"))
    for note in logger.notes:
        say(note)
    runtime = Runtime(recipe)
    ctx = make_context(recipe, run_dir, runtime, store, logger, say, ckpt=ckpt, summary={}, t_start=t_start)
    first_stage = 0
    if state is not None:
        first_stage, ctx.global_step, ctx.summary = state["stage_idx"], state["global_step"], dict(state["summary"])
        ctx.stage_minutes_before, ctx.restore_from, ctx.last_ckpt_step = state["stage_minutes"], restore_from, state["global_step"]
        ctx.first_token_pending = True
    info = runtime.policy.call_all("info")
    say(f"run dir {run_dir}: {info[0]['num_parameters'] / 1e6:.2f}M-parameter {'MoE' if recipe.model.is_moe else 'dense'} policy "
        f"on {len(info)} {'Ray' if runtime.remote else 'in-process'} worker(s), {len(recipe.stages)} stages")
    summary = ctx.summary
    try:
        with PreemptionGuard() as guard:
            ctx.guard = guard
            for i, stage in enumerate(recipe.stages):
                if i < first_stage:
                    continue
                t0 = ctx.stage_t0 = time.monotonic()
                ctx.bar = tqdm(total=stage.max_steps, desc=f"stage {i} {stage.type}", dynamic_ncols=True,
                               disable=not recipe.logging.progress_bar)
                STAGE_RUNNERS[stage.type](ctx, stage, i)
                ctx.bar.close()
                ctx.stage_minutes_before = 0.0
                metrics, ctx.stage_eval = ctx.stage_eval or evaluate(ctx), None  # taken at the stage-end checkpoint
                logger.log(metrics, step=ctx.global_step)
                key = f"{stage.type}_acc" if f"{stage.type}_acc" not in summary else f"{stage.type}{i}_acc"
                summary[key] = round(metrics["eval/accuracy"], 4)
                n = int(sum(v for k, v in metrics.items() if k.endswith("/num_problems")))
                say(f"stage {i} ({stage.type}): {ctx.global_step} steps so far, {(time.monotonic() - t0) / 60:.1f} min, "
                    f"held-out accuracy {metrics['eval/accuracy']:.3f} on {n} problems")
    except Preempted as p:
        if ctx.bar is not None:
            ctx.bar.close()
        say(f"preempted: checkpoint {p.checkpoint} written {time.monotonic() - guard.signal_time:.2f} s after the signal; "
            f"continue with: rl resume {run_dir}")
        summary = dict(summary, preempted=1, global_step=ctx.global_step)
    finally:
        runtime.shutdown()
        logger.close()
        store.close()
    summary["minutes"] = round((time.monotonic() - t_start) / 60, 2)
    return summary

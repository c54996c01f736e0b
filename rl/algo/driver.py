"""The training driver: run a recipe's stages in order on the runtime (Ray or in-process).

    train(recipe, run_dir):   open the job (rl/algo/job.py) -> for each stage: STAGE_RUNNERS[type](job, stage, i)
                              -> held-out accuracy in the summary -> RESULT <stage>_acc=... minutes=...

Stages:
- `sft` (`run_sft`, here): teacher forcing on demonstrations from each dataset's train stream
  (rl/algo/sft.py; demonstrations may contain the demonstrator's slips, see rewards/arithmetic.py),
  data-parallel over the workers.
- `grpo` / `opd` (rl/algo/async_grpo.py): asynchronous GRPO or on-policy distillation with sample-level
  dispatch, token-level interruption and state reuse across weight updates (seed §5.2); the `sync`
  dispatch policy is the no-overlap baseline.

Every stage ends with a held-out evaluation and a stage-end checkpoint that carries it. Preemption and
resume (rl/algo/resume.py): stage loops checkpoint at their token boundaries every `checkpoint.every_steps`
train steps and on SIGTERM/SIGINT (then the job exits 0); `train(..., resume=True)` re-enters the stage
that was running where it stopped, in-flight samples included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rl.algo.async_grpo import run_async_grpo
from rl.config import Recipe, SFTStage
from rl.algo.job import Job, StageResult, open_job
from rl.train.parallel import deal_by_length
from rl.checkpoint.preempt import Preempted, PreemptionGuard
from rl.algo.sft import DemonstrationStream
from rl.train.trainer import Diverged, timed_train_step


def run_sft(job: Job, stage: SFTStage, stage_idx: int) -> StageResult:
    """SFT: each step draws `batch_size` demonstrations, deals them to the workers by length (equal tokens per
    worker; every loss ÷ the whole batch's tokens) and takes one optimizer step."""
    policy = job.policy
    policy.begin_stage(stage)
    demos = DemonstrationStream(job.stage_tasks(stage), job.renderer, stage, seed_offset=1000 + stage_idx,
                                rng_seed=f"sft:{job.recipe.run.seed}:{stage_idx}",
                                tool_output_tokens=job.recipe.tools.max_tool_output_tokens if job.recipe.tools else None)
    start = 0
    restored = job.checkpointer.restore_stage(job)
    if restored is not None:
        start = restored["step"]
        demos.load_state_dict({"drawn": restored["drawn"], "rng": restored["rng"]})
        job.checkpointer.restored()

    def record(step: int) -> dict:
        return {"step": step, **demos.state_dict()}

    step = start - 1
    for step in job.budget(stage, start):
        if job.checkpointer.wanted(job.state.global_step):
            job.checkpointer.save(job, stage_idx, record(step))
        batch = demos.next_batch(stage.batch_size)
        parts = deal_by_length([len(p) + len(r) for p, r in zip(batch.prompts_B, batch.responses_B)], len(policy))
        metrics = timed_train_step(policy, [batch.select(part) for part in parts], stage)
        job.advance_version()
        job.record_train_step(stage, step, metrics)
        job.checkpointer.poll(job)
    return StageResult(job.stage_end_checkpoint(stage_idx, record(step + 1)))  # a longer budget continues from here


STAGE_RUNNERS: dict[str, Callable[[Job, SFTStage, int], StageResult]] = {
    "sft": run_sft, "grpo": run_async_grpo, "opd": run_async_grpo}
"""Stage runner by stage `type`."""


def describe_eval(metrics: Mapping[str, float]) -> str:
    """'held-out accuracy 0.312 on 256 problems (answered 0.98, truncated 0.01)' from evaluate()'s metrics."""
    n = int(sum(v for k, v in metrics.items() if k.endswith("/num_problems")))
    shares = ", ".join(f"{k} {metrics[f'eval/{k}']:.2f}" for k in ("answered", "truncated")
                       if not math.isnan(metrics.get(f"eval/{k}", math.nan)))
    return f"held-out accuracy {metrics['eval/accuracy']:.3f} on {n} problems" + (f" ({shares})" if shares else "")


def diverged_hint(job: Job, stage_idx: int) -> str:
    """What a diverged job leaves and how to go on: its newest checkpoint (a background write of one, taken before the
    divergence, committed first), written from finite weights, and the resume command."""
    job.checkpointer.finish(job)
    manager = job.checkpointer.manager
    newest = manager.latest() if manager is not None else None
    lr = f"--set stages.{stage_idx}.optim.lr=<lower>"
    if newest is None:
        return f"no checkpoint was written before it: fix the recipe (a lower lr) and start over with --overwrite {lr}"
    return (f"the newest checkpoint, {newest.name}, is the last good one: fix the recipe (a lower lr), then "
            f"rl resume {job.run_dir} {lr}")


def _run_stages(job: Job, say: Callable[[str], None]) -> dict:
    """The job's stages from where it stands; the summary (with `preempted=1` after a signal)."""
    recipe, run_dir, guard = job.recipe, job.run_dir, job.checkpointer.guard
    info = job.policy.info()
    say(f"run dir {run_dir}: {info[0]['num_parameters'] / 1e6:.2f}M-parameter {'MoE' if recipe.model.is_moe else 'dense'} "
        f"policy on {len(info)} {'Ray' if recipe.runtime.ray else 'in-process'} worker(s), {len(recipe.stages)} stages"
        + (f" (nodes {', '.join(dict.fromkeys(i['node_ip'] for i in info))})" if recipe.runtime.ray else ""))
    state, summary = job.state, job.state.summary
    if recipe.eval.before_training and state.first_stage == 0 and state.global_step == 0 and "init_acc" not in summary:
        metrics = job.evaluate()
        job.logger.log(metrics, step=0)
        summary["init_acc"] = round(metrics["eval/accuracy"], 4)
        say(f"before training: {describe_eval(metrics)}")
    try:
        for i in range(state.first_stage, len(recipe.stages)):
            stage = recipe.stages[i]
            state.stage_t0 = time.monotonic()
            job.progress.start_stage(i, stage)
            metrics = STAGE_RUNNERS[stage.type](job, stage, i).eval
            job.progress.close()
            state.stage_minutes_before = 0.0
            job.logger.log(metrics, step=state.global_step)
            key = f"{stage.type}_acc" if f"{stage.type}_acc" not in summary else f"{stage.type}{i}_acc"
            summary[key] = round(metrics["eval/accuracy"], 4)
            say(f"stage {i} ({stage.type}): {state.global_step} steps so far, "
                f"{(time.monotonic() - state.stage_t0) / 60:.1f} min, {describe_eval(metrics)}")
    except Diverged as d:  # a non-finite step, not applied (rl/train/trainer.py): the weights are the last good step's
        job.progress.close()
        raise Diverged(d.reason, state.global_step + 1, diverged_hint(job, i)) from None
    except Preempted as p:
        job.progress.close()
        say(f"preempted: checkpoint {p.checkpoint} written {time.monotonic() - guard.signal_time:.2f} s after the signal; "
            f"continue with: rl resume {run_dir}")
        summary = dict(summary, preempted=1, global_step=state.global_step)
    return summary


def train(recipe: Recipe, run_dir: Path, say: Callable[[str], None] = print, resume: bool = False, *,
          overwrite: bool = False, break_lock: bool = False, new_identity: bool = False) -> dict[str, float]:
    """Run every stage of the recipe (from the run's newest valid checkpoint when `resume`); returns
    the summary that the RESULT line prints. A SIGTERM/SIGINT ends it early with `preempted=1`.
    `overwrite`, `break_lock`: see rl/checkpoint/run_dir.py."""
    t_start = time.monotonic()
    guard = PreemptionGuard()
    try:
        with open_job(recipe, run_dir, say=say, resume=resume, overwrite=overwrite, break_lock=break_lock,
                      new_identity=new_identity) as job:
            guard.install()  # after ray.init's own SIGTERM handler; held through the job's teardown
            job.checkpointer.guard = guard
            guard.on_request.append(job.rewards.cut_short)  # verdicts stop waiting on user code (issue 40)
            summary = _run_stages(job, say)
    finally:
        guard.restore()
    summary["minutes"] = round((time.monotonic() - t_start) / 60, 2)
    return summary

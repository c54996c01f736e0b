"""The training driver: run a recipe's stages in order on the runtime (Ray or in-process).

Stages:
- `sft`: teacher forcing on demonstrations drawn from each dataset's train stream (demonstrations
  may contain the demonstrator's slips; see rewards/arithmetic.py), data-parallel over the workers.
- `grpo`: asynchronous GRPO with sample-level dispatch, token-level interruption and state reuse
  across weight updates (rl/async_grpo.py); the `sync` dispatch policy is the no-overlap baseline.

After every stage the driver evaluates greedy held-out accuracy, writes a checkpoint, and at the end
returns the summary that `rl train` prints as `RESULT <stage>_acc=... minutes=...`.

Preemption and resume (rl/checkpoint.py, rl/preempt.py): every stage loop calls
`checkpoint_wanted()` at its token boundaries; a resumable checkpoint is written every
`checkpoint.every_steps` train steps and on SIGTERM/SIGINT (then the job exits 0). `train(...,
resume=True)` restores the newest valid checkpoint, rolls the store back to its watermark and re-enters
the stage loop where it stopped; in-flight samples continue from their exact token.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from model.tokenizer import CharTokenizer
from rewards.arithmetic import ArithmeticTask, Problem, Verdict
from rewards.effort import with_effort
from rl.async_grpo import run_async_grpo
from rl.checkpoint import CheckpointError, CheckpointManager
from rl.config import GRPOStage, Recipe, SFTStage
from rl.metrics import MetricsLogger
from rl.preempt import Preempted, PreemptionGuard
from rl.recipe_io import recipe_to_yaml
from rl.runtime import Runtime
from rl.store import TrajectoryStore, Watermark
from rl.streams import Cursor
from rl.types import Prompt, Sample
from rollout.types import Generation, GenerationRequest


@dataclass
class RunContext:
    """What every stage needs; built once by `train`. Holds no model: the workers do."""

    recipe: Recipe
    run_dir: Path
    runtime: Runtime
    tasks: dict[str, ArithmeticTask]
    store: TrajectoryStore
    logger: MetricsLogger
    say: Callable[[str], None]
    tokenizer: CharTokenizer
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

    def generated(self, tokens: int) -> None:
        if self.first_token_pending and tokens:
            self.first_token_pending = False
            seconds = time.monotonic() - self.t_start
            self.say(f"resume: first new token {seconds:.2f} s after start")
            self.logger.log({"resume/first_token_s": seconds}, step=self.global_step)

    def prompt_text(self, problem: Problem, effort: int | None = None) -> str:
        """The prompt as the policy sees it: the effort prefix line (seed §5.1.4), then the problem."""
        return with_effort(problem.prompt, effort)

    def prompt_tokens(self, problem: Problem, effort: int | None = None) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(self.prompt_text(problem, effort), bos=True))

    def sample_seed(self, sample_id: str) -> int:
        digest = hashlib.blake2b(f"{self.recipe.run.seed}:{sample_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

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

    def save_checkpoint(self, stage_idx: int, stage_state: dict) -> Path | None:
        """Write a resumable checkpoint; call with every engine interrupted and rewards collected.
        After a preemption request, raises `Preempted` once it is written. No-op without a manager."""
        if self.ckpt is None:
            return None
        tmp = self.ckpt.begin(self.global_step)
        self.runtime.policy.call_all("save_state", str(tmp))
        controller = {"stage_idx": stage_idx, "stage_state": stage_state, "global_step": self.global_step,
                      "stage_minutes": self.stage_minutes_before + (time.monotonic() - self.stage_t0) / 60,
                      "watermark": self.store.watermark(self.global_step), "summary": dict(self.summary),
                      "recipe_yaml": recipe_to_yaml(self.recipe), "num_workers": len(self.runtime.policy)}
        path = self.ckpt.commit(tmp, self.global_step, controller)
        self.last_ckpt_step = self.global_step
        self.logger.log({"checkpoint/global_step": self.global_step}, step=self.global_step)
        if self.guard is not None and self.guard.requested:
            raise Preempted(str(path))
        return path

    def restore_inflight(self) -> list[list[str]]:
        """Hand the restored checkpoint's in-flight states to the workers (parked; `resume` continues
        them); returns each worker's sample ids."""
        files = sorted(str(p) for p in self.restore_from.glob("inflight-w*.msgpack"))
        return self.runtime.policy.call_all("load_inflight", files)

    def restore_stage(self, stage: SFTStage | GRPOStage) -> dict | None:
        """At a stage's start: load the checkpoint's weights/optimizer/RNG; returns the loop state."""
        if self.restore_from is None:
            return None
        self.runtime.policy.call_all("load_state", str(self.restore_from))
        self.runtime.policy.call_all("set_version", self.global_step)
        return CheckpointManager.controller_state(self.restore_from)["stage_state"]

    def to_sample(self, prompt: Prompt, problem: Problem, g: Generation, verdict: Verdict, status: str = "finished",
                  effort: int | None = None, teacher: str | None = None) -> Sample:
        """A rewarded trajectory; with effort, the subgroup is (prompt, effort) and the reward adds
        the effort-dependent length penalty (seed §5.1.4)."""
        text = self.tokenizer.decode(g.response_tokens)
        reward = verdict.reward
        if effort is not None:
            reward += self.recipe.effort.length_penalty(effort, self.tasks[prompt.dataset].reasoning_tokens(text))
        return Sample(
            sample_id=g.sample_id, prompt_id=prompt.prompt_id, dataset=prompt.dataset,
            group_id=prompt.prompt_id if effort is None else f"{prompt.prompt_id}@{effort}",
            prompt_tokens=g.prompt_tokens, response_tokens=g.response_tokens,
            prompt_text=self.prompt_text(problem, effort), response_text=text, behavior_logprobs_T=g.logprobs,
            policy_versions_T=g.policy_versions, reward=reward, correct=verdict.correct,
            finish_reason=g.finish_reason, status=status, routing_trace=g.routing_trace,
            timings={"finished_at": time.time(), "generate_s": g.generate_s},
            teacher=teacher, config_version=prompt.config_version, effort=effort,
        )

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


def _split(items: list, n: int) -> list[list]:
    return [items[i::n] for i in range(n)]


def evaluate(ctx: RunContext, effort: int | None = None) -> dict[str, float]:
    """Held-out accuracy and mean response length per dataset (greedy unless eval.temperature > 0).
    With effort conditioning the prompts carry the effort prefix (default: the highest level)."""
    cfg, policy, metrics, accs = ctx.recipe.eval, ctx.runtime.policy, {}, []
    if effort is None and ctx.recipe.effort is not None:
        effort = ctx.recipe.effort.levels[-1]
    for name, task in ctx.tasks.items():
        problems = task.heldout()[: cfg.max_problems]
        reqs = [GenerationRequest(f"eval-{p.problem_id}", ctx.prompt_tokens(p, effort), ctx.recipe.engine.max_new_tokens,
                                  seed=ctx.sample_seed(p.problem_id), temperature=cfg.temperature) for p in problems]
        gens = {g.sample_id: g for part in policy.get([policy.submit(w, "generate", chunk)
                                                        for w, chunk in enumerate(_split(reqs, len(policy)))]) for g in part}
        gens = [gens[r.sample_id] for r in reqs]
        correct = [task.verify(p, ctx.tokenizer.decode(g.response_tokens)).correct for p, g in zip(problems, gens)]
        metrics[f"eval/{name}/accuracy"] = sum(correct) / len(correct)
        metrics[f"eval/{name}/response_len"] = sum(len(g.response_tokens) for g in gens) / len(gens)
        metrics[f"eval/{name}/num_problems"] = len(problems)
        accs.append(metrics[f"eval/{name}/accuracy"])
    metrics["eval/accuracy"] = sum(accs) / len(accs)
    return metrics


def cold_start(stage: SFTStage, effort: int | None) -> dict:
    """Demonstration options at effort level b for the effort cold start (seed §5.1.4, App. C)."""
    if not stage.effort_cold_start or effort is None:
        return {}
    if stage.cold_start_style == "partial":
        return {"reasoning_frac": effort / 100}
    return {"direct_answer_rate": 1 - effort / 100}


def run_sft(ctx: RunContext, stage: SFTStage, stage_idx: int) -> None:
    policy = ctx.runtime.policy
    policy.call_all("begin_stage", stage)
    streams = [Cursor(t, seed_offset=1000 + stage_idx) for t in ctx.tasks.values()]
    rng = random.Random(f"sft:{ctx.recipe.run.seed}:{stage_idx}")
    start, drawn = 0, 0
    restored = ctx.restore_stage(stage)
    if restored is not None:
        start, drawn = restored["step"], restored["drawn"]
        rng.setstate(restored["rng"])
        for i, c in enumerate(streams):  # round-robin: stream i has drawn ceil((drawn - i) / n)
            c.skip_to(max(0, -(-(drawn - i) // len(streams))))
        ctx.restore_from = None

    def next_problem() -> Problem:  # round-robin over datasets
        nonlocal drawn
        drawn += 1
        return next(streams[(drawn - 1) % len(streams)])

    def checkpoint(step: int) -> None:
        ctx.save_checkpoint(stage_idx, {"step": step, "drawn": drawn, "rng": rng.getstate()})

    step = start - 1
    for step in ctx.budget(stage, start):
        if ctx.checkpoint_wanted():
            checkpoint(step)
        batch = [next_problem() for _ in range(stage.batch_size)]
        levels = ctx.recipe.effort.levels if ctx.recipe.effort else None
        efforts = [rng.choice(levels) if levels and rng.random() < stage.effort_prefix_frac else None for _ in batch]
        prompts = [ctx.prompt_tokens(p, b) for p, b in zip(batch, efforts)]
        responses = [ctx.tokenizer.encode(ctx.tasks[p.dataset].demonstration(p, rng, **cold_start(stage, b)), eos=True)
                     for p, b in zip(batch, efforts)]
        num_tokens = float(sum(len(r) for r in responses))
        futs = [policy.submit(w, "sft_step", p, r, num_tokens)
                for w, (p, r) in enumerate(zip(_split(prompts, len(policy)), _split(responses, len(policy))))]
        per_rank = policy.get(futs)
        metrics = dict(per_rank[0], **{"sft/loss": sum(m["sft/loss"] for m in per_rank)})
        ctx.global_step += 1
        policy.call_all("set_version", ctx.global_step)
        ctx.after_train_step(stage, step, metrics)
    checkpoint(step + 1)  # stage end: a resume with a larger budget continues from here


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
    path = ckpt.latest()
    if path is None:
        say(f"resume: no complete checkpoint under {ckpt.root}; starting from the beginning")
        store.rollback_to(Watermark(0, 0), checkpoint="")
        return None, None
    state = CheckpointManager.controller_state(path)
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
    ctx = RunContext(recipe=recipe, run_dir=run_dir, runtime=runtime, tasks={d.name: d.build() for d in recipe.datasets},
                     store=store, logger=logger, say=say, tokenizer=CharTokenizer(), ckpt=ckpt, summary={}, t_start=t_start)
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
                metrics = evaluate(ctx)
                logger.log(metrics, step=ctx.global_step)
                runtime.policy.get(runtime.policy.submit(0, "save", str(run_dir / "checkpoints" / f"stage{i}-{stage.type}"),
                                                         {"global_step": ctx.global_step, "stage": i, "eval": metrics}))
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

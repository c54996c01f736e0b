"""The training driver: run a recipe's stages in order on the runtime (Ray or in-process).

Stages:
- `sft`: teacher forcing on demonstrations drawn from each dataset's train stream (demonstrations
  may contain the demonstrator's slips; see rewards/arithmetic.py), data-parallel over the workers.
- `grpo`: asynchronous GRPO with sample-level dispatch, token-level interruption and state reuse
  across weight updates (rl/async_grpo.py); the `sync` dispatch policy is the no-overlap baseline.

After every stage the driver evaluates greedy held-out accuracy, writes a checkpoint, and at the end
returns the summary that `rl train` prints as `RESULT <stage>_acc=... minutes=...`.
"""

from __future__ import annotations

import hashlib
import itertools
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
from rl.config import GRPOStage, Recipe, SFTStage
from rl.metrics import MetricsLogger
from rl.recipe_io import recipe_to_yaml
from rl.runtime import Runtime
from rl.store import TrajectoryStore
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
    global_step: int = 0
    bar: tqdm | None = None

    def prompt_text(self, problem: Problem, effort: int | None = None) -> str:
        """The prompt as the policy sees it: the effort prefix line (seed §5.1.4), then the problem."""
        return with_effort(problem.prompt, effort)

    def prompt_tokens(self, problem: Problem, effort: int | None = None) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(self.prompt_text(problem, effort), bos=True))

    def sample_seed(self, sample_id: str) -> int:
        digest = hashlib.blake2b(f"{self.recipe.run.seed}:{sample_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    @staticmethod
    def budget(max_steps: int, max_minutes: float | None) -> Iterator[int]:
        deadline = None if max_minutes is None else time.monotonic() + 60.0 * max_minutes
        for step in range(max_steps):
            if deadline is not None and time.monotonic() >= deadline:
                return
            yield step

    def to_sample(self, prompt: Prompt, problem: Problem, g: Generation, verdict: Verdict, status: str = "finished",
                  effort: int | None = None) -> Sample:
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


def run_sft(ctx: RunContext, stage: SFTStage, stage_idx: int) -> None:
    policy = ctx.runtime.policy
    policy.call_all("begin_stage", stage)
    streams = [t.train_stream(seed_offset=1000 + stage_idx) for t in ctx.tasks.values()]
    problems = (next(s) for s in itertools.cycle(streams))  # round-robin over datasets
    rng = random.Random(f"sft:{ctx.recipe.run.seed}:{stage_idx}")
    for step in ctx.budget(stage.max_steps, stage.max_minutes):
        batch = [next(problems) for _ in range(stage.batch_size)]
        levels = ctx.recipe.effort.levels if ctx.recipe.effort else None
        efforts = [rng.choice(levels) if levels and rng.random() < stage.effort_prefix_frac else None for _ in batch]
        prompts = [ctx.prompt_tokens(p, b) for p, b in zip(batch, efforts)]
        responses = [ctx.tokenizer.encode(ctx.tasks[p.dataset].demonstration(
            p, rng, direct_answer_rate=1 - b / 100 if stage.effort_cold_start and b is not None else None), eos=True)
            for p, b in zip(batch, efforts)]
        num_tokens = float(sum(len(r) for r in responses))
        futs = [policy.submit(w, "sft_step", p, r, num_tokens)
                for w, (p, r) in enumerate(zip(_split(prompts, len(policy)), _split(responses, len(policy))))]
        per_rank = policy.get(futs)
        metrics = dict(per_rank[0], **{"sft/loss": sum(m["sft/loss"] for m in per_rank)})
        ctx.global_step += 1
        policy.call_all("set_version", ctx.global_step)
        ctx.after_train_step(stage, step, metrics)


STAGE_RUNNERS = {"sft": run_sft, "grpo": run_async_grpo}


def train(recipe: Recipe, run_dir: Path, say: Callable[[str], None] = print) -> dict[str, float]:
    """Run every stage of the recipe; returns the summary that the RESULT line prints."""
    t_start = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_yaml = recipe_to_yaml(recipe)
    (run_dir / "recipe.yaml").write_text(recipe_yaml)
    store = TrajectoryStore.for_run_dir(run_dir, url=recipe.store.url)
    store.add_run(recipe.run.name, recipe_yaml)
    logger = MetricsLogger(run_dir, recipe.logging, run_name=recipe.run.name, config=recipe.model_dump(mode="json"))
    for note in logger.notes:
        say(note)
    runtime = Runtime(recipe)
    ctx = RunContext(recipe=recipe, run_dir=run_dir, runtime=runtime, tasks={d.name: d.build() for d in recipe.datasets},
                     store=store, logger=logger, say=say, tokenizer=CharTokenizer())
    info = runtime.policy.call_all("info")
    say(f"run dir {run_dir}: {info[0]['num_parameters'] / 1e6:.2f}M-parameter {'MoE' if recipe.model.is_moe else 'dense'} policy "
        f"on {len(info)} {'Ray' if runtime.remote else 'in-process'} worker(s), {len(recipe.stages)} stages")
    summary: dict[str, float] = {}
    try:
        for i, stage in enumerate(recipe.stages):
            t0 = time.monotonic()
            ctx.bar = tqdm(total=stage.max_steps, desc=f"stage {i} {stage.type}", dynamic_ncols=True,
                           disable=not recipe.logging.progress_bar)
            STAGE_RUNNERS[stage.type](ctx, stage, i)
            ctx.bar.close()
            metrics = evaluate(ctx)
            logger.log(metrics, step=ctx.global_step)
            runtime.policy.get(runtime.policy.submit(0, "save", str(run_dir / "checkpoints" / f"stage{i}-{stage.type}"),
                                                     {"global_step": ctx.global_step, "stage": i, "eval": metrics}))
            key = f"{stage.type}_acc" if f"{stage.type}_acc" not in summary else f"{stage.type}{i}_acc"
            summary[key] = round(metrics["eval/accuracy"], 4)
            n = int(sum(v for k, v in metrics.items() if k.endswith("/num_problems")))
            say(f"stage {i} ({stage.type}): {ctx.global_step} steps so far, {(time.monotonic() - t0) / 60:.1f} min, "
                f"held-out accuracy {metrics['eval/accuracy']:.3f} on {n} problems")
    finally:
        runtime.shutdown()
        logger.close()
        store.close()
    summary["minutes"] = round((time.monotonic() - t_start) / 60, 2)
    return summary

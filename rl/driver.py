"""The training driver v0: run a recipe's stages in order on one colocated device.

Stages:
- `sft`: teacher forcing on demonstrations drawn from each dataset's train stream (demonstrations
  may contain the demonstrator's slips; see rewards/arithmetic.py).
- `grpo`: synchronous GRPO. Each step dispatches `prompts_per_step` prompts × `group_size` samples
  to the engine (continuous batching), verifies and stores every finished sample, and takes one
  optimizer step on the batch; the engine shares the policy module, so the update is in place and
  `policy_version` (= optimizer steps so far) advances by one. This is the `sync` baseline; the async
  runtime (sample-level dispatch, token-level interruption) replaces the loop body, not its parts.

After every stage the driver evaluates greedy held-out accuracy, writes a checkpoint, and at the
end prints `RESULT <stage>_acc=... minutes=...`.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from model.checkpoint import load_checkpoint, save_checkpoint
from model.decoder import Decoder
from model.tokenizer import CharTokenizer
from rewards.arithmetic import ArithmeticTask, Problem
from rl.config import GRPOStage, Recipe, SFTStage
from rl.metrics import MetricsLogger
from rl.recipe_io import recipe_to_yaml
from rl.store import TrajectoryStore
from rl.trainer import Trainer
from rl.types import Prompt, Sample
from rollout.engine import Engine
from rollout.types import Generation, GenerationRequest

TOKENIZER = CharTokenizer()


def prompt_tokens(problem: Problem) -> tuple[int, ...]:
    return tuple(TOKENIZER.encode(problem.prompt, bos=True))


def sample_seed(run_seed: int, sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_seed}:{sample_id}".encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class RunContext:
    """What every stage needs; built once by `train`."""

    recipe: Recipe
    run_dir: Path
    model: Decoder
    engine: Engine
    tasks: dict[str, ArithmeticTask]
    store: TrajectoryStore
    logger: MetricsLogger
    say: Callable[[str], None]
    global_step: int = 0
    prompt_counter: int = 0


def _budget(max_steps: int, max_minutes: float | None) -> Iterator[int]:
    deadline = None if max_minutes is None else time.monotonic() + 60.0 * max_minutes
    for step in range(max_steps):
        if deadline is not None and time.monotonic() >= deadline:
            return
        yield step


def _mixture(ctx: RunContext, seed_offset: int) -> Iterator[Problem]:
    """Round-robin over the datasets' train streams."""
    streams = [t.train_stream(seed_offset) for t in ctx.tasks.values()]
    for stream in itertools.cycle(streams):
        yield next(stream)


def _bar(ctx: RunContext, total: int, desc: str):
    return tqdm(total=total, desc=desc, disable=not ctx.recipe.logging.progress_bar, dynamic_ncols=True, leave=True)


def evaluate(ctx: RunContext) -> dict[str, float]:
    """Held-out accuracy and mean response length per dataset (greedy unless eval.temperature > 0)."""
    cfg, metrics = ctx.recipe.eval, {}
    accs = []
    for name, task in ctx.tasks.items():
        problems = task.heldout()[: cfg.max_problems]
        reqs = [
            GenerationRequest(f"eval-{p.problem_id}", prompt_tokens(p), ctx.recipe.engine.max_new_tokens,
                              seed=sample_seed(ctx.recipe.run.seed, p.problem_id), temperature=cfg.temperature)
            for p in problems
        ]
        ctx.model.eval()
        gens = ctx.engine.generate(reqs)
        correct = [task.verify(p, TOKENIZER.decode(g.response_tokens)).correct for p, g in zip(problems, gens)]
        metrics[f"eval/{name}/accuracy"] = sum(correct) / len(correct)
        metrics[f"eval/{name}/response_len"] = sum(len(g.response_tokens) for g in gens) / len(gens)
        metrics[f"eval/{name}/num_problems"] = len(problems)
        accs.append(metrics[f"eval/{name}/accuracy"])
    metrics["eval/accuracy"] = sum(accs) / len(accs)
    return metrics


def run_sft(ctx: RunContext, stage: SFTStage, stage_idx: int) -> None:
    trainer = Trainer(ctx.model, stage.optim)
    problems = _mixture(ctx, seed_offset=1000 + stage_idx)
    rng = random.Random(f"sft:{ctx.recipe.run.seed}:{stage_idx}")
    bar = _bar(ctx, stage.max_steps, f"stage {stage_idx} sft")
    for step in _budget(stage.max_steps, stage.max_minutes):
        batch = [next(problems) for _ in range(stage.batch_size)]
        demos = [ctx.tasks[p.dataset].demonstration(p, rng) for p in batch]
        metrics = trainer.sft_step([prompt_tokens(p) for p in batch], [TOKENIZER.encode(d, eos=True) for d in demos])
        ctx.global_step += 1
        ctx.engine.policy_version = ctx.global_step
        bar.update(1)
        if step % stage.log_every == 0:
            ctx.logger.log(metrics, step=ctx.global_step)
            bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
    bar.close()


def _to_samples(ctx: RunContext, prompts: dict[str, tuple[Prompt, Problem]], gens: list[Generation], t_dispatch: float) -> list[Sample]:
    samples = []
    for g in gens:
        prompt, problem = prompts[g.sample_id.rsplit("-", 1)[0]]
        text = TOKENIZER.decode(g.response_tokens)
        verdict = ctx.tasks[problem.dataset].verify(problem, text)
        samples.append(Sample(
            sample_id=g.sample_id, prompt_id=prompt.prompt_id, dataset=prompt.dataset, group_id=prompt.prompt_id,
            prompt_tokens=g.prompt_tokens, response_tokens=g.response_tokens, prompt_text=prompt.text,
            response_text=text, behavior_logprobs_T=g.logprobs, policy_versions_T=g.policy_versions,
            reward=verdict.reward, correct=verdict.correct, finish_reason=g.finish_reason,
            timings={"dispatched_at": t_dispatch, "finished_at": time.time(), "generate_s": g.generate_s},
            routing_trace=g.routing_trace,
        ))
    return samples


def run_grpo(ctx: RunContext, stage: GRPOStage, stage_idx: int) -> None:
    trainer = Trainer(ctx.model, stage.optim)
    problems = _mixture(ctx, seed_offset=2000 + stage_idx)
    sampling = ctx.recipe.engine.sampling
    bar = _bar(ctx, stage.max_steps, f"stage {stage_idx} grpo")
    for step in _budget(stage.max_steps, stage.max_minutes):
        # Dispatch a batch of groups (sync policy: no overlap between rollout and training).
        t_dispatch, prompts, requests = time.time(), {}, []
        for _ in range(stage.prompts_per_step):
            problem = next(problems)
            pid = f"p{ctx.prompt_counter:07d}"
            ctx.prompt_counter += 1
            toks = prompt_tokens(problem)
            prompts[pid] = (Prompt(pid, problem.dataset, problem.prompt, toks, problem.answer, stage.group_size,
                                   ctx.engine.policy_version), problem)
            for j in range(stage.group_size):
                sid = f"{pid}-{j}"
                requests.append(GenerationRequest(sid, toks, ctx.recipe.engine.max_new_tokens,
                                                  seed=sample_seed(ctx.recipe.run.seed, sid),
                                                  temperature=sampling.temperature, top_p=sampling.top_p))
        ctx.model.eval()
        t0 = time.perf_counter()
        gens = ctx.engine.generate(requests)
        gen_s = time.perf_counter() - t0
        samples = _to_samples(ctx, prompts, gens, t_dispatch)
        ctx.store.add_prompts([p for p, _ in prompts.values()])
        ctx.store.add_samples(samples)

        t1 = time.perf_counter()
        metrics = trainer.grpo_step(samples, stage, temperature=sampling.temperature or 1.0)
        train_s = time.perf_counter() - t1
        ctx.global_step += 1
        ctx.engine.policy_version = ctx.global_step  # weights were updated in place
        ctx.store.mark_trained([s.sample_id for s in samples], ctx.global_step)

        n_tok = sum(s.num_response_tokens for s in samples)
        metrics.update({
            "rollout/reward": sum(s.reward for s in samples) / len(samples),
            "rollout/accuracy": sum(s.correct for s in samples) / len(samples),
            "rollout/response_len": n_tok / len(samples),
            "rollout/tokens_per_s": n_tok / gen_s,
            "rollout/generate_s": gen_s,
            "train/step_s": train_s,
            "train/policy_version": ctx.global_step,
        })
        if stage.eval_every and (step + 1) % stage.eval_every == 0:
            metrics.update(evaluate(ctx))
        ctx.store.add_train_step(ctx.global_step, metrics)
        bar.update(1)
        if step % stage.log_every == 0:
            ctx.logger.log(metrics, step=ctx.global_step)
            bar.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", len=f"{metrics['rollout/response_len']:.0f}",
                            tok_s=f"{metrics['rollout/tokens_per_s']:.0f}")
    bar.close()


STAGE_RUNNERS = {"sft": run_sft, "grpo": run_grpo}


def build_policy(recipe: Recipe) -> Decoder:
    torch.manual_seed(recipe.run.seed)
    if recipe.run.init_checkpoint is not None:
        return load_checkpoint(recipe.run.init_checkpoint, device=recipe.run.device)  # shape checked by Recipe
    return Decoder(recipe.model).to(recipe.run.device)


def train(recipe: Recipe, run_dir: Path, say: Callable[[str], None] = print) -> dict[str, float]:
    """Run every stage of the recipe; returns the summary that the RESULT line prints."""
    t_start = time.monotonic()
    torch.set_num_threads(recipe.run.num_threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_yaml = recipe_to_yaml(recipe)
    (run_dir / "recipe.yaml").write_text(recipe_yaml)
    model = build_policy(recipe)
    store = TrajectoryStore.for_run_dir(run_dir, url=recipe.store.url)
    store.add_run(recipe.run.name, recipe_yaml)
    logger = MetricsLogger(run_dir, recipe.logging, run_name=recipe.run.name, config=recipe.model_dump(mode="json"))
    for note in logger.notes:
        say(note)
    ctx = RunContext(
        recipe=recipe, run_dir=run_dir, model=model,
        engine=Engine(model, recipe.engine, eos_id=TOKENIZER.eos_id, device=recipe.run.device),
        tasks={d.name: d.build() for d in recipe.datasets}, store=store, logger=logger, say=say,
    )
    say(f"run dir {run_dir}: {model.num_parameters() / 1e6:.2f}M-parameter {'MoE' if recipe.model.is_moe else 'dense'} policy, "
        f"{len(recipe.stages)} stages")
    summary: dict[str, float] = {}
    try:
        for i, stage in enumerate(recipe.stages):
            t0 = time.monotonic()
            STAGE_RUNNERS[stage.type](ctx, stage, i)
            metrics = evaluate(ctx)
            ctx.logger.log(metrics, step=ctx.global_step)
            save_checkpoint(model, run_dir / "checkpoints" / f"stage{i}-{stage.type}",
                            extra={"global_step": ctx.global_step, "stage": i, "eval": metrics})
            key = f"{stage.type}_acc" if f"{stage.type}_acc" not in summary else f"{stage.type}{i}_acc"
            summary[key] = round(metrics["eval/accuracy"], 4)
            say(f"stage {i} ({stage.type}): {ctx.global_step} steps so far, {(time.monotonic() - t0) / 60:.1f} min, "
                f"held-out accuracy {metrics['eval/accuracy']:.3f} on "
                f"{int(sum(v for k, v in metrics.items() if k.endswith('/num_problems')))} problems")
    finally:
        logger.close()
        store.close()
    summary["minutes"] = round((time.monotonic() - t_start) / 60, 2)
    return summary

"""Asynchronous GRPO on colocated, time-shared PolicyWorkers (seed §5.2.1-§5.2.3).

The algorithm, per train step:
  ROLLOUT   every engine advances each of its sequences by `steps_per_call` tokens; finished samples
            go to the reward workers and the store; the dispatcher releases new prompts by its policy
            (`sample`: as soon as the samples finished since the last release reach the next prompt's
            group size), keeping `max_inflight` samples generating.
  WAIT      until the dispatcher's train-batch condition holds: `prompts_per_step` complete groups
            within the off-policy bounds (exact definitions in rl/dispatch.py).
  INTERRUPT every engine stops at the current token boundary; in-flight `RolloutState`s (KV cache,
            routing trace, logprobs, versions) move to host memory.
  TRAIN     one optimizer step, data-parallel over the workers (a group is never split); the weights
            change in place; policy_version += 1.
  RESUME    the states go back into the KV pools and generation continues from the exact token with
            no prefill. New tokens carry the new version, so each sample's segments
            [(start, end, version)] and its concatenated routing trace record where it changed hands.

Departures from the textbook: the behaviour logprob in the clipped ratio is recorded per token at
generation time, so a sample spanning several versions is corrected token by token; `sync` is this
same loop with no overlap between rollout and training (the baseline).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from rewards.arithmetic import Problem
from rl.config import GRPOStage
from rl.dispatch import Dispatcher, FinishedMeta, Ticket
from rl.losses import group_advantages
from rl.types import Prompt, Sample
from rollout.types import Generation, GenerationRequest


def prompt_id_of(sample_id: str) -> str:
    return sample_id.rsplit("-", 1)[0]


@dataclass
class RolloutClock:
    """Concurrency and time accounting of the rollout phases (metrics and benchmarks)."""

    concurrency: list[float] = field(default_factory=list)
    """Sequences generating per engine step (tokens generated ÷ steps), summed over engines, per call."""
    interrupt_s: list[float] = field(default_factory=list)
    """Signal-to-idle time of every interrupt."""
    interrupt_late_steps: list[int] = field(default_factory=list)
    """Engine steps run after the batch became ready and before the engines stopped."""
    rollout_s: float = 0.0
    train_s: float = 0.0
    generated_tokens: int = 0
    bytes_moved: int = 0


def _merge_rank_metrics(per_rank: list[dict], tokens: list[int]) -> dict:
    """Token-weighted mean over ranks; the loss terms (already ÷ global tokens) add up."""
    total = max(sum(tokens), 1)
    out = dict(per_rank[0])
    for k in per_rank[0]:
        if k == "rl/loss":
            out[k] = sum(m[k] for m in per_rank)
        elif k.startswith("rl/"):
            out[k] = sum(m[k] * n for m, n in zip(per_rank, tokens)) / total
    return out


def run_async_grpo(ctx, stage: GRPOStage, stage_idx: int) -> RolloutClock:
    """`ctx` is the driver's RunContext: runtime, store, tasks, recipe, logging hooks."""
    rt, recipe = ctx.runtime, ctx.recipe
    policy, n_workers = rt.policy, len(rt.policy)
    disp = Dispatcher(stage.dispatch, datasets=list(ctx.tasks), group_size=stage.group_size,
                      prompts_per_step=stage.prompts_per_step, seed=recipe.run.seed + stage_idx,
                      id_prefix=f"s{stage_idx}-p")
    disp.version = ctx.global_step
    streams = {d: task.train_stream(seed_offset=2000 + stage_idx) for d, task in ctx.tasks.items()}
    sampling = recipe.engine.sampling
    prompts: dict[str, tuple[Prompt, Problem]] = {}
    finished: dict[str, list[Sample]] = defaultdict(list)  # prompt_id -> rewarded samples
    load = [0] * n_workers  # unfinished samples per worker
    pending_rewards: list[tuple[object, list[Generation]]] = []
    clock = RolloutClock()
    effort = recipe.effort
    effort_of: dict[str, int | None] = {}  # sample_id -> effort level
    policy.call_all("begin_stage", stage)

    def release(tickets: list[Ticket]) -> None:
        per_worker: dict[int, list[GenerationRequest]] = defaultdict(list)
        for t in tickets:
            problem = next(streams[t.dataset])
            prompt = Prompt(t.prompt_id, t.dataset, problem.prompt, ctx.prompt_tokens(problem), problem.answer,
                            t.group_size, t.version)
            prompts[t.prompt_id] = (prompt, problem)
            ctx.store.add_prompts([prompt])
            # With effort conditioning the group is M_b samples at each level b (one group to the dispatcher).
            levels = [b for b in effort.levels for _ in range(effort.samples_per_level)] if effort else [None] * t.group_size
            for j, b in enumerate(levels):  # engines split the in-flight samples, least-loaded first
                w = min(range(n_workers), key=load.__getitem__)
                load[w] += 1
                sid = f"{t.prompt_id}-{j}"
                effort_of[sid] = b
                toks = ctx.prompt_tokens(problem, b)
                forced = ctx.tasks[t.dataset].response_budget(problem, j)
                per_worker[w].append(GenerationRequest(
                    sid, toks, forced or recipe.engine.max_new_tokens, seed=ctx.sample_seed(sid),
                    temperature=sampling.temperature, top_p=sampling.top_p, ignore_eos=forced is not None))
        policy.get([policy.submit(w, "add", reqs) for w, reqs in per_worker.items()])

    def collect_rewards(block: bool) -> None:
        while pending_rewards and (block or rt.rewards.ready([pending_rewards[0][0]])):
            fut, gens = pending_rewards.pop(0)
            samples = [ctx.to_sample(*prompts[prompt_id_of(g.sample_id)], g, verdict,
                                     status="discarded" if disp.is_discarded(prompt_id_of(g.sample_id)) else "finished",
                                     effort=effort_of.pop(g.sample_id))
                       for g, verdict in zip(gens, rt.rewards.get(fut))]
            ctx.store.add_samples(samples)
            for s in samples:
                if s.status == "finished":
                    finished[s.prompt_id].append(s)

    def tokens_of(pid: str) -> tuple[int, int]:
        ss = finished[pid]
        return sum(s.num_response_tokens for s in ss), sum(v < disp.version for s in ss for v in s.policy_versions_T)

    for step in ctx.budget(stage.max_steps, stage.max_minutes):
        # ROLLOUT until the dispatcher's train-batch condition holds.
        t_roll = time.perf_counter()
        while True:
            tickets = disp.dispatch()
            release(tickets)
            results = policy.call_all("step", stage.steps_per_call)
            gens = [g for r in results for g in r.finished]
            for w, r in enumerate(results):
                load[w] -= len(r.finished)
            clock.concurrency.append(sum(r.generated / max(r.steps, 1) for r in results))
            clock.generated_tokens += sum(r.generated for r in results)
            for g in gens:
                disp.on_finished(FinishedMeta(g.sample_id, prompt_id_of(g.sample_id), len(g.response_tokens),
                                              min(g.policy_versions)))
            if gens:
                items = [(prompts[prompt_id_of(g.sample_id)][1], ctx.tokenizer.decode(g.response_tokens)) for g in gens]
                pending_rewards.append((rt.rewards.submit(len(pending_rewards) % len(rt.rewards), "verify", items), gens))
            collect_rewards(block=False)
            batch = None
            if disp.num_ready_groups >= stage.prompts_per_step:
                collect_rewards(block=True)  # a ready group's rewards must be in before it trains
                batch = disp.take_batch([v for r in results for v in r.oldest_versions], tokens_of)
            if batch is not None:
                # the batch became ready at the step that finished its last member in this call
                chosen = set(batch)
                ready_at = max((i for r in results for g, i in zip(r.finished, r.finish_step)
                                if prompt_id_of(g.sample_id) in chosen), default=-1)
                steps_run = max(r.steps for r in results)
                clock.interrupt_late_steps.append(max(0, steps_run - 1 - ready_at) if ready_at >= 0 else 0)
                break
            if not tickets and not any(r.active or r.waiting for r in results):
                raise RuntimeError(f"rollout stalled at step {step}: nothing in flight, the dispatcher releases nothing "
                                   f"and no batch fits the off-policy bounds ({disp.stats})")
        clock.rollout_s += time.perf_counter() - t_roll

        # INTERRUPT at the token boundary; in-flight states move to host memory.
        t_sig = time.perf_counter()
        held = policy.call_all("interrupt")
        clock.interrupt_s.append(time.perf_counter() - t_sig)

        # TRAIN one optimizer step on whole groups, data-parallel across the workers.
        t_train = time.perf_counter()
        groups = [finished.pop(pid) for pid in batch]
        samples = [s for g in groups for s in g]
        adv = dict(zip((s.sample_id for s in samples), group_advantages(
            [s.reward for s in samples], [s.group_id for s in samples], std_normalize=stage.std_normalize)))
        num_tokens = float(sum(s.num_response_tokens for s in samples))
        shards = [[s for g in groups[w::n_workers] for s in g] for w in range(n_workers)]
        per_rank = policy.get([policy.submit(w, "grpo_step", shard, [adv[s.sample_id] for s in shard], num_tokens,
                                             stage, sampling.temperature or 1.0) for w, shard in enumerate(shards)])
        metrics = _merge_rank_metrics(per_rank, [sum(s.num_response_tokens for s in sh) for sh in shards])
        ctx.global_step += 1
        disp.on_train_step()
        policy.call_all("set_version", ctx.global_step)
        ctx.store.mark_trained([s.sample_id for s in samples], ctx.global_step)
        clock.train_s += time.perf_counter() - t_train

        # RESUME: the engines continue every parked sample from its exact token, with no prefill.
        resumed = policy.call_all("resume")
        moved = sum(h["bytes"] for h in held) + sum(r["bytes"] for r in resumed)
        clock.bytes_moved += moved

        trained_version = ctx.global_step - 1  # the weights this step's gradient was taken at
        versions = [v for s in samples for v in s.policy_versions_T]
        metrics.update({
            "rollout/reward": sum(s.reward for s in samples) / len(samples),
            "rollout/accuracy": sum(s.correct for s in samples) / len(samples),
            "rollout/response_len": len(versions) / len(samples),
            "rollout/tokens_per_s": clock.generated_tokens / max(clock.rollout_s, 1e-9),
            "rollout/concurrency_mean": sum(clock.concurrency) / max(len(clock.concurrency), 1),
            "async/max_version_lag": max(trained_version - v for v in versions) if versions else 0,
            "async/stale_token_frac": sum(v < trained_version for v in versions) / max(len(versions), 1),
            "async/interrupt_s": clock.interrupt_s[-1],
            "async/states_held": sum(h["states"] for h in held),
            "async/state_bytes_held": sum(h["bytes"] for h in held),
            "async/state_bytes_moved": moved,
            "dispatch/inflight": disp.total_inflight,
            "dispatch/cap_skips": disp.stats.cap_skips,
            "dispatch/discarded_samples": disp.stats.discarded_samples,
            "dispatch/dropped_stale_groups": disp.stats.dropped_stale_groups,
            "dispatch/lag_waits": disp.stats.lag_waits,
            "train/policy_version": ctx.global_step,
            "time/rollout_s": clock.rollout_s,
            "time/train_s": clock.train_s,
        })
        ctx.after_train_step(stage, step, metrics)

    # Stage over: drop what is still in flight (its prompts are recorded; samples never trained).
    policy.call_all("interrupt")
    policy.call_all("discard_held")
    collect_rewards(block=True)
    return clock

"""Trainer v0: SFT steps on demonstrations and GRPO steps on sampled trajectories.

The trainer owns the optimizer and updates the policy's weights in place; the engine holds the same
module (colocated), so after `step()` the next rollout token already uses the new weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.decoder import Decoder
from rl.config import GRPOStage, OptimConfig
from rl.losses import PolicyLossInputs, grpo_loss, group_advantages, sft_loss, token_logprobs
from rl.types import Sample


@dataclass
class PackedBatch:
    """Right-padded teacher-forcing batch; position t predicts targets[:, t] from input_ids[:, :t+1]."""

    input_ids: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1.0 on response targets
    behavior_logprobs: torch.Tensor  # [B, T] (zeros off the response)
    routing: torch.Tensor | None = None  # [B, T, L, k] recorded expert ids of each input token


def pack(prompts_B: Sequence[Sequence[int]], responses_B: Sequence[Sequence[int]],
         behavior_B: Sequence[Sequence[float]] | None = None, routing_B: Sequence | None = None,
         device: str | torch.device = "cpu") -> PackedBatch:
    seqs = [list(p) + list(r) for p, r in zip(prompts_B, responses_B)]
    B, T = len(seqs), max(len(s) for s in seqs) - 1
    input_ids = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    behav = torch.zeros(B, T)
    routing = None
    for i, (s, p, r) in enumerate(zip(seqs, prompts_B, responses_B)):
        n = len(s) - 1
        input_ids[i, :n] = torch.tensor(s[:-1])
        targets[i, :n] = torch.tensor(s[1:])
        P, R = len(p), len(r)
        mask[i, P - 1 : P - 1 + R] = 1.0
        if behavior_B is not None:
            behav[i, P - 1 : P - 1 + R] = torch.tensor(behavior_B[i], dtype=torch.float32)
        if routing_B is not None and routing_B[i] is not None:
            tr = torch.as_tensor(routing_B[i]).long()
            if routing is None:
                routing = torch.zeros(B, T, *tr.shape[1:], dtype=torch.long)
            routing[i, : tr.shape[0]] = tr
    return PackedBatch(*(t.to(device) for t in (input_ids, targets, mask, behav)),
                       routing=None if routing is None else routing.to(device))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    warm = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched


class Trainer:
    def __init__(self, model: Decoder, optim: OptimConfig, device: str | torch.device = "cpu"):
        self.model, self.optim_cfg, self.device = model, optim, device
        self.opt, self.sched = build_optimizer(model, optim)

    def _apply(self) -> float:
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(gnorm)

    def sft_step(self, prompts_B: Sequence[Sequence[int]], responses_B: Sequence[Sequence[int]]) -> dict[str, float]:
        self.model.train()
        b = pack(prompts_B, responses_B, device=self.device)
        logits, _ = self.model(b.input_ids)
        loss, metrics = sft_loss(logits, b.targets, b.mask)
        loss.backward()
        metrics["train/grad_norm"] = self._apply()
        metrics["train/lr"] = self.sched.get_last_lr()[0]
        return metrics

    def grpo_step(self, samples: Sequence[Sample], cfg: GRPOStage, *, temperature: float) -> dict[str, float]:
        """One optimizer step on a batch of complete groups (gradient accumulated over micro-batches)."""
        self.model.train()
        adv_B = group_advantages([s.reward for s in samples], [s.group_id for s in samples], std_normalize=cfg.std_normalize)
        num_tokens = float(sum(s.num_response_tokens for s in samples))
        totals: dict[str, float] = {}
        for lo in range(0, len(samples), cfg.micro_batch_size):
            mb = samples[lo : lo + cfg.micro_batch_size]
            b = pack([s.prompt_tokens for s in mb], [s.response_tokens for s in mb],
                     [s.behavior_logprobs_T for s in mb], device=self.device)
            logits, _ = self.model(b.input_ids)
            x = PolicyLossInputs(
                logprobs=token_logprobs(logits, b.targets, temperature),
                behavior_logprobs=b.behavior_logprobs,
                advantages=torch.tensor(adv_B[lo : lo + len(mb)], dtype=torch.float32, device=self.device),
                mask=b.mask,
                num_tokens=num_tokens,
            )
            loss, metrics = grpo_loss(x, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
            loss.backward()
            w = float(b.mask.sum()) / num_tokens  # token-weighted average of per-micro-batch metrics
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + w * v
            totals["rl/loss"] = totals.get("rl/loss", 0.0) + float(loss.detach())
        totals["train/grad_norm"] = self._apply()
        totals["train/lr"] = self.sched.get_last_lr()[0]
        totals["rl/adv_abs_mean"] = sum(abs(a) for a in adv_B) / len(adv_B)
        return totals

"""Losses as pure functions over shape-annotated inputs. Each returns (loss, metrics).

GRPO objective (token-level aggregation, decoupled clip):

    A_i      = r_i − mean_{j ∈ group(i)} r_j            (optionally ÷ (std_group + ε))
    ρ_{i,t}  = exp(log π_θ(y_t | ·) − log π_behav(y_t | ·))   (behaviour = recorded rollout logprob)
    L        = (1 / N_tok) Σ_{i,t} max(−A_i ρ_{i,t}, −A_i clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high))

where N_tok is the number of response tokens in the whole train batch (not the micro-batch), so
micro-batches add up to the same gradient as one big batch. The reported `rl/kl_behavior` is the
k3 estimator E[(ρ − 1) − log ρ] of KL(π_behav ‖ π_θ) over response tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(rewards_B: Sequence[float], groups_B: Sequence[str], *, std_normalize: bool, eps: float = 1e-6) -> list[float]:
    """Mean-centred rewards within each group (a singleton group gets 0); optionally ÷ group std."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups_B):
        members[g].append(i)
    adv = [0.0] * len(rewards_B)
    for idx in members.values():
        r = torch.tensor([float(rewards_B[i]) for i in idx], dtype=torch.float64)
        a = r - r.mean()
        if std_normalize and len(idx) > 1:
            a = a / (r.std(unbiased=False) + eps)
        for i, v in zip(idx, a.tolist()):
            adv[i] = v
    return adv


@dataclass
class PolicyLossInputs:
    logprobs: torch.Tensor
    """[B, T] log π_θ of the target tokens (grad flows)."""
    behavior_logprobs: torch.Tensor
    """[B, T] recorded rollout logprobs."""
    advantages: torch.Tensor
    """[B] per-sample advantage."""
    mask: torch.Tensor
    """[B, T] 1.0 on response tokens that enter the loss."""
    num_tokens: float
    """Normaliser: response tokens in the whole train batch."""


def grpo_loss(x: PolicyLossInputs, *, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict[str, float]]:
    log_ratio = (x.logprobs - x.behavior_logprobs) * x.mask
    ratio = log_ratio.exp()
    adv = x.advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = (per_token * x.mask).sum() / x.num_tokens
    with torch.no_grad():
        n = x.mask.sum().clamp_min(1.0)
        metrics = {
            "rl/clip_frac": float(((clipped > unclipped).float() * x.mask).sum() / n),
            "rl/kl_behavior": float((((ratio - 1.0) - log_ratio) * x.mask).sum() / n),
            "rl/ratio_mean": float((ratio * x.mask).sum() / n),
        }
    return loss, metrics


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log softmax(logits / temperature) at the targets [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1)


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
             num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy summed over response tokens ÷ num_tokens (default: this batch's response tokens;
    data-parallel callers pass the global count). logits [B, T, V]; targets, mask [B, T]."""
    nll = -token_logprobs(logits, targets) * mask
    n = float(mask.sum().clamp_min(1.0)) if num_tokens is None else num_tokens
    loss = nll.sum() / n
    return loss, {"sft/loss": float(loss.detach())}

"""Losses as pure functions over shape-annotated inputs. Each returns (loss, metrics).

GRPO objective (token-level aggregation, decoupled clip, staleness mask; seed §5.2.2):

    A_i      = r_i − mean_{j ∈ subgroup(i)} r_j          (optionally ÷ (std_subgroup + ε))
    keep_t   = 1[v_cur − v_t ≤ max_staleness]            (v_t: version that generated token t)
    L        = (1 / N_tok) Σ_{i,t} keep_t · w_t · max(−A_i ρ_t, −A_i clip(ρ_t, 1 − ε_low, 1 + ε_high))
               [+ β (1 / N_tok) Σ_{i,t} keep_t · k3_t(π_θ, π_ref)  with `kl_ref_coef` β > 0: `reference_kl`]

N_tok counts every response token of the whole train batch, masked ones included: a stale token leaves
the sum but not the normaliser, so masking never rescales the remaining tokens' gradient. The ratio
ρ_t and the weight w_t depend on `ratio`:

    behavior:  ρ_t = π_θ(y_t) / π_behav(y_t),   w_t = 1
    proximal:  ρ_t = π_θ(y_t) / sg(π_θ(y_t)),   w_t = sg(min(π_θ(y_t) / π_behav(y_t), tis_cap))

`behavior` clips the ratio against the recorded rollout logprob directly (PPO against the behaviour
policy). `proximal` is the decoupled objective with the proximal policy taken as the weights at the
start of the step (one optimizer step per batch): the clip acts on the step's own update and the
behaviour mismatch enters as a truncated, detached token-level importance weight (tis_cap None: not
truncated). The reported `rl/kl_behavior` is the k3 estimator E[(ρ_b − 1) − log ρ_b] of
KL(π_behav ‖ π_θ), ρ_b = π_θ / π_behav, over response tokens.
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
    """Normaliser: response tokens in the whole train batch, stale ones included."""
    keep: torch.Tensor | None = None
    """[B, T] 1.0 where the token is fresh enough to train on (staleness mask); None keeps all."""


def staleness_keep(versions: torch.Tensor, mask: torch.Tensor, current_version: int, max_staleness: int | None,
                   max_sample_stale_frac: float | None = None) -> torch.Tensor:
    """[B, T] keep mask: token staleness = current_version − versions ≤ max_staleness; a sample whose
    share of stale response tokens exceeds max_sample_stale_frac is dropped whole."""
    keep = torch.ones_like(mask)
    if max_staleness is not None:
        keep = ((current_version - versions) <= max_staleness).to(mask.dtype)
    if max_sample_stale_frac is not None:
        stale = ((1 - keep) * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        keep = keep * (stale <= max_sample_stale_frac).to(mask.dtype)[:, None]
    return keep


def grpo_loss(x: PolicyLossInputs, *, clip_low: float, clip_high: float, ratio: str = "behavior",
              tis_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    m = x.mask
    keep = m if x.keep is None else m * x.keep
    log_ratio_b = (x.logprobs - x.behavior_logprobs) * m  # against the behaviour policy
    if ratio == "behavior":
        log_ratio, weight = log_ratio_b, torch.ones_like(m)
    elif ratio == "proximal":
        log_ratio = (x.logprobs - x.logprobs.detach()) * m
        weight = log_ratio_b.detach().exp()
        if tis_cap is not None:
            weight = weight.clamp(max=tis_cap)
    else:
        raise ValueError(f"unknown ratio reference {ratio!r}")
    rho = log_ratio.exp()
    adv = x.advantages[:, None]
    unclipped = -adv * rho
    clipped = -adv * rho.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = weight * torch.maximum(unclipped, clipped)
    loss = (per_token * keep).sum() / x.num_tokens
    with torch.no_grad():
        n = m.sum().clamp_min(1.0)
        rho_b = log_ratio_b.exp()
        metrics = {
            "rl/clip_frac": float(((clipped > unclipped).float() * keep).sum() / n),
            "rl/kl_behavior": float((((rho_b - 1.0) - log_ratio_b) * m).sum() / n),
            "rl/ratio_mean": float((rho_b * m).sum() / n),
            "stale/masked_frac": float(((m - keep)).sum() / n),
        }
        if ratio == "proximal":
            metrics["rl/tis_weight_mean"] = float((weight * m).sum() / n)
            if tis_cap is not None:
                metrics["rl/tis_truncated_frac"] = float(((rho_b > tis_cap).float() * m).sum() / n)
    return loss, metrics


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token k3 estimator of KL(π_θ ‖ π_ref) on tokens sampled from (nearly) π_θ:
    k3 = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1 ≥ 0, unbiased with low variance (the
    `low_var_kl` of verl, TRL's `beta` term). The gradient flows through `logprobs` only."""
    d = ref_logprobs.detach() - logprobs
    return d.exp() - d - 1.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log softmax(logits / temperature) at the targets [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy summed over response tokens ÷ num_tokens (default: this batch's response tokens;
    data-parallel callers pass the global count). logprobs (of the targets), mask [B, T]."""
    nll = -logprobs * mask
    n = float(mask.sum().clamp_min(1.0)) if num_tokens is None else num_tokens
    loss = nll.sum() / n
    return loss, {"sft/loss": float(loss.detach())}

"""Trainer v0: SFT steps on demonstrations and GRPO steps on sampled trajectories.

The trainer owns the optimizer and updates the policy's weights in place; the engine holds the same
module (colocated), so after a step the next rollout token already uses the new weights. With a
torch.distributed process group (several PolicyWorkers) each rank computes its shard's loss
normalised by the *global* token count and gradients are summed across ranks before clipping, so
every rank applies the same update as one big batch would.

CSA2 models (seed §2.3) add the indexer KL (seed §3.1.2) to each micro-batch's loss, weighted by
`sparse_attention.aux_loss_weight` and by the micro-batch's share of the global response tokens, so the
added term is the token-weighted mean over the batch (summed across ranks, like the policy loss). Its
gradient reaches only the indexer; it is logged as `train/indexer_kl`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.decoder import Decoder
from rl.config import GRPOStage, OptimConfig
from rl.losses import PolicyLossInputs, grpo_loss, group_advantages, sft_loss, staleness_keep, token_logprobs
from rl.types import Sample


@dataclass
class PackedBatch:
    """Right-padded teacher-forcing batch; position t predicts targets[:, t] from input_ids[:, :t+1]."""

    input_ids: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1.0 on response targets
    behavior_logprobs: torch.Tensor  # [B, T] (zeros off the response)
    routing: torch.Tensor | None = None  # [B, T, L, k] recorded expert ids of each input token
    versions: torch.Tensor | None = None  # [B, T] policy version of each response target token
    lengths: torch.Tensor | None = None  # [B] real (unpadded) tokens of each row of input_ids

    def token_mask(self) -> torch.Tensor:
        """[B, T] bool: True on real tokens, False on right padding (all True without `lengths`)."""
        T = self.input_ids.shape[1]
        if self.lengths is None:
            return torch.ones_like(self.input_ids, dtype=torch.bool)
        return torch.arange(T, device=self.input_ids.device) < self.lengths[:, None]


def pack(prompts_B: Sequence[Sequence[int]], responses_B: Sequence[Sequence[int]],
         behavior_B: Sequence[Sequence[float]] | None = None, routing_B: Sequence | None = None,
         versions_B: Sequence[Sequence[int]] | None = None, device: str | torch.device = "cpu") -> PackedBatch:
    seqs = [list(p) + list(r) for p, r in zip(prompts_B, responses_B)]
    B, T = len(seqs), max(len(s) for s in seqs) - 1
    input_ids = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    behav = torch.zeros(B, T)
    versions = torch.zeros(B, T, dtype=torch.long) if versions_B is not None else None
    routing = None
    for i, (s, p, r) in enumerate(zip(seqs, prompts_B, responses_B)):
        n = len(s) - 1
        input_ids[i, :n] = torch.tensor(s[:-1])
        targets[i, :n] = torch.tensor(s[1:])
        P, R = len(p), len(r)
        mask[i, P - 1 : P - 1 + R] = 1.0
        if behavior_B is not None:
            behav[i, P - 1 : P - 1 + R] = torch.tensor(behavior_B[i], dtype=torch.float32)
        if versions is not None:
            versions[i, P - 1 : P - 1 + R] = torch.tensor(versions_B[i], dtype=torch.long)
        if routing_B is not None and routing_B[i] is not None:
            tr = torch.tensor(routing_B[i], dtype=torch.long)  # a copy: arrays from Ray are read-only
            if routing is None:
                routing = torch.zeros(B, T, *tr.shape[1:], dtype=torch.long)
            routing[i, : tr.shape[0]] = tr
    return PackedBatch(*(t.to(device) for t in (input_ids, targets, mask, behav)),
                       routing=None if routing is None else routing.to(device),
                       versions=None if versions is None else versions.to(device),
                       lengths=torch.tensor([len(s) - 1 for s in seqs], device=device))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    warm = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Trainer:
    def __init__(self, model: Decoder, optim: OptimConfig, device: str | torch.device = "cpu"):
        self.model, self.optim_cfg, self.device = model, optim, device
        self.opt, self.sched = build_optimizer(model, optim)

    def _forward(self, b: PackedBatch, routing_replay: torch.Tensor | None = None,
                 checkpoint_layers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits [B, T, V] float32, indexer KL scalar for CSA2 models (over real tokens) else None)."""
        sparse = self.model.config.is_sparse
        out = self.model.forward_hidden(b.input_ids, routing_replay=routing_replay, checkpoint_layers=checkpoint_layers,
                                        compute_indexer_loss=sparse, indexer_query_mask=b.token_mask() if sparse else None)
        return self.model.logits(out.hidden), out.indexer_loss

    def _with_indexer_loss(self, loss: torch.Tensor, indexer_kl: torch.Tensor | None, share: float) -> torch.Tensor:
        """loss + aux_loss_weight · share · indexer_kl; share = this micro-batch's fraction of the global
        response tokens (so the shares of all micro-batches on all ranks sum to 1)."""
        if indexer_kl is None:
            return loss
        return loss + self.model.config.sparse_attention.aux_loss_weight * share * indexer_kl

    def _apply(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if _distributed():  # one flat all-reduce instead of one per parameter
            for p in params:  # a rank whose shard never reached some parameter still joins the sum
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.optim_cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(gnorm)

    def sft_step(self, prompts_B: Sequence[Sequence[int]], responses_B: Sequence[Sequence[int]],
                 num_tokens: float | None = None) -> dict[str, float]:
        """num_tokens: response tokens of the whole (global) batch; default this shard's."""
        self.model.train()
        b = pack(prompts_B, responses_B, device=self.device)
        logits, indexer_kl = self._forward(b)
        loss, metrics = sft_loss(logits, b.targets, b.mask, num_tokens)
        n_mb = float(b.mask.sum())
        loss = self._with_indexer_loss(loss, indexer_kl, n_mb / (num_tokens if num_tokens is not None else max(n_mb, 1.0)))
        if indexer_kl is not None:
            metrics["train/indexer_kl"] = float(indexer_kl.detach())
        loss.backward()
        metrics["train/grad_norm"] = self._apply()
        metrics["train/lr"] = self.sched.get_last_lr()[0]
        return metrics

    def grpo_step(self, samples: Sequence[Sample], cfg: GRPOStage, *, temperature: float,
                  advantages_B: Sequence[float] | None = None, num_tokens: float | None = None,
                  current_version: int | None = None) -> dict[str, float]:
        """One optimizer step on complete groups (gradient accumulated over micro-batches).

        Data-parallel callers pass the advantages (computed on whole groups) and the global token count.
        current_version: the version of the weights being trained (staleness is measured against it);
        default: the newest token version in the batch.
        """
        self.model.train()
        if advantages_B is None:
            advantages_B = group_advantages([s.reward for s in samples], [s.group_id for s in samples],
                                            std_normalize=cfg.std_normalize)
        local_tokens = float(sum(s.num_response_tokens for s in samples))
        num_tokens = local_tokens if num_tokens is None else num_tokens
        version = current_version if current_version is not None else max(
            (max(s.policy_versions_T) for s in samples if s.policy_versions_T), default=0)
        # Micro-batches of similar length: padding to the longest member wastes little (long tails).
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_tokens) + samples[i].num_response_tokens)
        samples = [samples[i] for i in order]
        advantages_B = [advantages_B[i] for i in order]
        totals: dict[str, float] = {}
        for lo in range(0, len(samples), cfg.micro_batch_size):
            mb = samples[lo : lo + cfg.micro_batch_size]
            replay = cfg.routing_replay and self.model.config.is_moe
            b = pack([s.prompt_tokens for s in mb], [s.response_tokens for s in mb], [s.behavior_logprobs_T for s in mb],
                     routing_B=[s.routing_trace for s in mb] if replay else None,
                     versions_B=[s.policy_versions_T for s in mb], device=self.device)
            if replay and b.routing is None:
                raise ValueError("routing_replay is on but the samples carry no routing trace")
            logits, indexer_kl = self._forward(b, routing_replay=b.routing,
                                               checkpoint_layers=cfg.activation_checkpointing)
            x = PolicyLossInputs(
                logprobs=token_logprobs(logits, b.targets, temperature),
                behavior_logprobs=b.behavior_logprobs,
                advantages=torch.tensor(advantages_B[lo : lo + len(mb)], dtype=torch.float32, device=self.device),
                mask=b.mask,
                num_tokens=num_tokens,
                keep=staleness_keep(b.versions, b.mask, version, cfg.max_staleness, cfg.max_sample_stale_frac),
            )
            loss, metrics = grpo_loss(x, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      ratio=cfg.importance.ratio, tis_cap=cfg.importance.tis_cap)
            totals["rl/loss"] = totals.get("rl/loss", 0.0) + float(loss.detach())
            if indexer_kl is not None:
                metrics["train/indexer_kl"] = float(indexer_kl.detach())
            loss = self._with_indexer_loss(loss, indexer_kl, float(b.mask.sum()) / max(num_tokens, 1.0))
            loss.backward()
            w = float(b.mask.sum()) / max(local_tokens, 1.0)  # token-weighted mean over micro-batches
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + w * v
        totals["train/grad_norm"] = self._apply()
        totals["train/lr"] = self.sched.get_last_lr()[0]
        totals["rl/adv_abs_mean"] = sum(abs(a) for a in advantages_B) / max(len(advantages_B), 1)
        return totals

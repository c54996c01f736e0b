"""One OPD optimizer step (seed §5.2.4): full-vocabulary reverse KL to each sample's teacher, on the
student's own samples, optionally mixed with the GRPO loss.

    loss = kl_weight · Σ_{samples, response positions t} KL(π_s(·|x_<t) || π_t(·|x_<t)) / N
         + rl_weight · GRPO loss (rl/losses.py; the same token normaliser N)

N is the global number of response tokens of the step (data-parallel ranks sum their gradients).
Staleness masking applies to both terms: a token masked out of the GRPO loss (rl/losses.py
`staleness_keep`) also leaves the KL. Per micro-batch the student runs one forward to its final hidden
states; the samples are grouped by teacher and `TeacherPool.run` scores each group with that teacher
resident (each teacher is loaded at most once per micro-batch, the next one prefetched meanwhile); the
KL is computed chunk by chunk from the two models' hidden states and output heads
(model/reverse_kl.py), so no [tokens, vocab] float32 tensor exists for the batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from model.reverse_kl import reverse_kl_loss
from rl.config import OPDStage
from rl.losses import PolicyLossInputs, grpo_loss, staleness_keep, token_logprobs
from rl.trainer import Trainer, pack
from rl.types import Sample


def opd_step(trainer: Trainer, pool, samples: Sequence[Sample], teachers_B: Sequence[str], cfg: OPDStage, *,
             advantages_B: Sequence[float], num_tokens: float, temperature: float, current_version: int) -> dict[str, float]:
    """One optimizer step; `teachers_B[i]` names the teacher that scores `samples[i]`."""
    model = trainer.model
    model.train()
    local_tokens = float(sum(s.num_response_tokens for s in samples))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_tokens) + samples[i].num_response_tokens)
    totals: dict[str, float] = defaultdict(float)
    kl_by_teacher: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # name -> [Σ KL, tokens]
    head = model.lm_head.weight
    micro = [order[lo : lo + cfg.micro_batch_size] for lo in range(0, len(order), cfg.micro_batch_size)]
    for k, idx in enumerate(micro):
        # the pool starts copying the next micro-batch's first missing teacher once this one's are in
        upcoming = list(dict.fromkeys(teachers_B[i] for i in micro[k + 1])) if k + 1 < len(micro) else []
        mb = [samples[i] for i in idx]
        replay = cfg.routing_replay and model.config.is_moe
        b = pack([s.prompt_tokens for s in mb], [s.response_tokens for s in mb], [s.behavior_logprobs_T for s in mb],
                 routing_B=[s.routing_trace for s in mb] if replay else None,
                 versions_B=[s.policy_versions_T for s in mb], device=trainer.device)
        out = model.forward_hidden(b.input_ids, routing_replay=b.routing, checkpoint_layers=cfg.activation_checkpointing)
        keep = staleness_keep(b.versions, b.mask, current_version, cfg.max_staleness, cfg.max_sample_stale_frac)
        weights = b.mask if keep is None else b.mask * keep
        loss = torch.zeros((), device=trainer.device)
        if cfg.kl_weight > 0:
            rows: dict[str, list[int]] = defaultdict(list)
            for j, i in enumerate(idx):
                rows[teachers_B[i]].append(j)
            rows_t = {name: torch.tensor(r, device=trainer.device) for name, r in rows.items()}

            def score(name, teacher_out):
                r = rows_t[name]
                kl_loss, kl_tok = reverse_kl_loss(out.hidden[r], head, teacher_out.hidden.to(out.hidden.dtype),
                                                  teacher_out.head_weight.to(head.dtype), weights=weights[r],
                                                  normalizer=num_tokens, impl=cfg.kl_impl, chunk_size=cfg.kl_chunk_size)
                acc = kl_by_teacher[name]
                acc[0] += float(kl_tok.sum())
                acc[1] += float(weights[r].sum())
                return kl_loss

            kl_terms = pool.run({name: b.input_ids[r] for name, r in rows_t.items()}, score, next_teachers=upcoming)
            kl = sum(kl_terms.values())
            loss = loss + cfg.kl_weight * kl
            totals["opd/kl_loss"] += float(kl.detach())
        if cfg.rl_weight > 0:
            logits = model.lm_head(out.hidden).float()
            x = PolicyLossInputs(
                logprobs=token_logprobs(logits, b.targets, temperature), behavior_logprobs=b.behavior_logprobs,
                advantages=torch.tensor([advantages_B[i] for i in idx], dtype=torch.float32, device=trainer.device),
                mask=b.mask, num_tokens=num_tokens, keep=keep)
            rl_loss, metrics = grpo_loss(x, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                         ratio=cfg.importance.ratio, tis_cap=cfg.importance.tis_cap)
            loss = loss + cfg.rl_weight * rl_loss
            w = float(b.mask.sum()) / max(local_tokens, 1.0)
            for k, v in metrics.items():
                totals[k] += w * v
            totals["rl/loss"] += float(rl_loss.detach())
        loss.backward()
    out_metrics = dict(totals)
    out_metrics["train/grad_norm"] = trainer._apply()
    out_metrics["train/lr"] = trainer.sched.get_last_lr()[0]
    kl_sum, kl_tokens = sum(v[0] for v in kl_by_teacher.values()), sum(v[1] for v in kl_by_teacher.values())
    out_metrics["opd/kl_per_token"] = kl_sum / max(kl_tokens, 1.0)
    out_metrics["opd/teachers_in_step"] = len(kl_by_teacher)
    out_metrics["opd/kl_tokens"] = kl_tokens
    out_metrics.update(pool.stats().as_metrics())
    return out_metrics

"""The training objectives that plug into the trainer's micro-batch loop (rl/train/trainer.py): SFT, GRPO and
OPD. Each is built on the worker from its stage config plus runtime handles (`build_objective`), and for
each micro-batch runs the forward it needs and returns its `LossTerms`; the formulas are in
rl/train/losses.py (GRPO, SFT) and model/reverse_kl.py (the OPD KL).

OPD (seed §5.2.4):

    loss = kl_weight · Σ_{samples, response positions t} KL(π_s(·|x_<t) || π_t(·|x_<t)) / N
         + rl_weight · GRPO loss (rl/train/losses.py; the same token normaliser N)

N is the global number of response tokens of the step. Staleness masking applies to both terms: a token
masked out of the GRPO loss (`staleness_keep`) also leaves the KL. Per micro-batch the student runs one
forward to its final hidden states; the rows are grouped by teacher and `TeacherPool.run` scores each
group with that teacher resident (each teacher loaded at most once per micro-batch; the next
micro-batch's first missing teacher prefetched meanwhile); the KL is computed chunk by chunk from the two
models' hidden states and output heads, so no [tokens, vocab] float32 tensor exists for the batch.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from model.decoder import Decoder
from model.lora import adapters_off
from model.reverse_kl import reverse_kl_loss
from model.token_logprobs import token_logprobs
from rl.config import GRPOStage, OPDStage, SFTStage
from rl.train.losses import PolicyLossInputs, grpo_loss, reference_kl, sft_loss, staleness_keep
from rl.train.trainer import LossTerms, PackedBatch, StepMetrics, TrainBatch


ENTROPY_CHUNK_ROWS = 1024
"""Rows of the [positions, vocab] log-probabilities per chunk of the `rl/entropy` metric (its temporaries)."""

LOGPROBS = "chunked"
"""How `response_logprobs` computes the trained tokens' log-probs and entropy: "chunked" (model/token_logprobs.py:
from the hidden states and the output head in chunks of tokens, forward and backward, never a [tokens, vocab]
tensor; a Triton kernel on CUDA) or "materialised" (the [tokens, vocab] float32 logits and their log-softmax, as
before issue #41; bench/train_step.py compares the two)."""
LOGPROB_CHUNK_ROWS: int | None = None
"""Tokens per chunk of the chunked path (None: model/token_logprobs.py `default_chunk_size`, ~512 MiB of logits)."""


def _forward_hidden(model: Decoder, b: PackedBatch, routing: bool = False,
                    checkpoint_layers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (final hidden states [B, T, hidden], or [1, N, hidden] for a packed batch (`PackedBatch.at` reads them),
    the CSA2 indexer KL over real tokens, or None for dense attention). `routing`: replay the recorded expert ids."""
    sparse = model.config.is_sparse
    out = model.forward_hidden(**b.forward_kwargs(routing), checkpoint_layers=checkpoint_layers,
                               compute_indexer_loss=sparse, indexer_query_mask=b.token_mask() if sparse else None)
    return out.hidden, out.indexer_loss


def response_logprobs(model: Decoder, hidden: torch.Tensor, b: PackedBatch, temperature: float = 1.0,
                      stats: dict[str, float] | None = None, entropy: list[torch.Tensor] | None = None) -> torch.Tensor:
    """log softmax(logits / temperature) at the targets, [B, T] float32, on the trained response positions
    (b.mask > 0) and 0 elsewhere. The output head and the log-softmax run on those positions alone, not on
    prompts and padding: the [B, T, vocab] float32 logits were most of a small model's step (bench/train_step.py);
    every loss term here is masked to these positions, so no value changes. `stats`: gets "rl/entropy", the mean
    over those positions of the policy's entropy -Σ_v p(v) log p(v) at this temperature (verl's actor/entropy: a
    collapsing entropy is a policy that stopped exploring), without gradient. `entropy`: gets that entropy per
    position, [B, T] (0 off the trained positions), with gradient (the `entropy_coef` bonus); then "rl/entropy" is
    its mean."""
    idx = (b.mask > 0).nonzero(as_tuple=True)
    if LOGPROBS == "chunked":
        return _chunked_logprobs(model, b.at(hidden, idx), b, idx, temperature, stats, entropy)
    logp = torch.log_softmax(model.logits(b.at(hidden, idx)).float() / temperature, dim=-1)
    lp = logp.gather(-1, b.targets[idx][:, None]).squeeze(-1)
    if entropy is not None:  # log p is finite here (a log-softmax of finite logits): no 0 · -inf
        ent = -(logp.exp() * logp).sum(-1)
        entropy.append(torch.zeros(b.targets.shape, dtype=ent.dtype, device=ent.device).index_put(idx, ent))
        if stats is not None:
            stats["rl/entropy"] = float(ent.detach().mean()) if ent.numel() else 0.0
    elif stats is not None:
        with torch.no_grad():  # p · log p with log p clamped (a zero-probability id adds 0, not nan), in chunks
            lo = torch.finfo(logp.dtype).min  # of rows so that the temporaries stay small beside the logits
            ent = sum((c.exp() * c.clamp_min(lo)).sum() for c in logp.split(ENTROPY_CHUNK_ROWS))
            stats["rl/entropy"] = -float(ent) / logp.shape[0] if logp.shape[0] else 0.0  # one read
    return torch.zeros(b.targets.shape, dtype=lp.dtype, device=lp.device).index_put(idx, lp)


def _tokens_by_default(stage: SFTStage | GRPOStage) -> bool:
    """Neither micro_batch_size nor micro_batch_tokens set in the recipe: a packed CUDA trainer cuts micro-batches
    by tokens (rl/config.py `PACKED_TOKENS_CUDA`)."""
    return not {"micro_batch_size", "micro_batch_tokens"} & stage.model_fields_set


def _chunked_logprobs(model: Decoder, h: torch.Tensor, b: PackedBatch, idx: tuple[torch.Tensor, torch.Tensor],
                      temperature: float, stats: dict[str, float] | None, entropy: list[torch.Tensor] | None
                      ) -> torch.Tensor:
    """`response_logprobs` through model/token_logprobs.py. The output head's matmul runs in the dtype autocast gives
    it (bf16 under mixed precision, as `model.logits` would), the softmax statistics in float32."""
    w = model.lm_head.weight
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
    else:
        dtype = torch.promote_types(h.dtype, w.dtype)
    with torch.autocast(h.device.type, enabled=False):
        lp, ent = token_logprobs(h.to(dtype), w.to(dtype), b.targets[idx], temperature,
                                 entropy=entropy is not None or stats is not None, chunk_size=LOGPROB_CHUNK_ROWS)
    if ent is not None and stats is not None:
        stats["rl/entropy"] = float(ent.detach().mean()) if ent.numel() else 0.0
    if entropy is not None:
        entropy.append(torch.zeros(b.targets.shape, dtype=ent.dtype, device=ent.device).index_put(idx, ent))
    return torch.zeros(b.targets.shape, dtype=lp.dtype, device=lp.device).index_put(idx, lp)


class SFTObjective:
    """Cross-entropy on the demonstrations' response tokens (and EOS)."""

    routing_replay = False
    pads = True  # `Objective.pads`
    packs = True  # `Objective.packs`

    def __init__(self, stage: SFTStage, **_handles):
        self.micro_batch_size, self.micro_batch_tokens = stage.micro_batch_size, stage.micro_batch_tokens
        self.packing = stage.packing
        self.tokens_by_default = _tokens_by_default(stage)

    def __call__(self, model: Decoder, b: PackedBatch, rows: TrainBatch, upcoming: TrainBatch | None) -> LossTerms:
        hidden, indexer_kl = _forward_hidden(model, b)
        loss, metrics = sft_loss(response_logprobs(model, hidden, b), b.mask, rows.num_tokens)
        return LossTerms(loss, sums=metrics, indexer_kl=indexer_kl)

    def step_metrics(self) -> StepMetrics:
        return StepMetrics()


class GRPOObjective:
    """The clipped, staleness-masked policy loss of rl/train/losses.py on whole groups."""

    pads = True  # `Objective.pads`: the reference policy has the policy's positions
    packs = True  # `Objective.packs`: so does the reference policy's forward

    def __init__(self, stage: GRPOStage, *, model: Decoder, temperature: float, current_version: int,
                 reference: Decoder | None = None, **_handles):
        self.stage, self.temperature, self.current_version = stage, temperature, current_version
        self.micro_batch_size, self.micro_batch_tokens = stage.micro_batch_size, stage.micro_batch_tokens
        self.packing = stage.packing
        self.tokens_by_default = _tokens_by_default(stage)
        self.routing_replay = stage.routing_replay and model.config.is_moe
        self.reference = reference
        """The run's initial policy (frozen), when the stage penalises the KL to it."""
        if stage.kl_ref_coef > 0 and reference is None:
            raise ValueError("kl_ref_coef > 0 needs the reference policy")

    def keep(self, b: PackedBatch) -> torch.Tensor:
        s = self.stage
        return staleness_keep(b.versions, b.mask, self.current_version, s.max_staleness, s.max_sample_stale_frac)

    def policy_terms(self, model: Decoder, hidden: torch.Tensor, b: PackedBatch, rows: TrainBatch,
                     keep: torch.Tensor) -> LossTerms:
        s = self.stage
        entropy: dict[str, float] = {}
        bonus: list[torch.Tensor] | None = [] if s.entropy_coef > 0 else None
        x = PolicyLossInputs(
            logprobs=response_logprobs(model, hidden, b, self.temperature, entropy, bonus),
            behavior_logprobs=b.behavior_logprobs,
            advantages=torch.tensor(list(rows.advantages_B), dtype=torch.float32, device=b.input_ids.device),
            mask=b.mask, num_tokens=rows.num_tokens, keep=keep)
        loss, metrics = grpo_loss(x, clip_low=s.clip_low, clip_high=s.clip_high, ratio=s.importance.ratio,
                                  tis_cap=s.importance.tis_cap)
        if bonus:  # the exploration bonus (verl's entropy_coeff): - coef · the kept tokens' entropy ÷ the step's tokens
            kept, coef = b.mask * keep, s.entropy_coef
            if s.entropy_target is not None:  # on only below the target entropy, in proportion to the shortfall
                mean = float((bonus[0].detach() * kept).sum() / kept.sum().clamp_min(1.0))
                coef *= max(0.0, 1.0 - mean / s.entropy_target)
                metrics["rl/entropy_coef"] = coef
            loss = loss - coef * (bonus[0] * kept).sum() / rows.num_tokens
        if s.kl_ref_coef > 0:
            with torch.no_grad(), adapters_off(self.reference):  # LoRA: the base is the reference, no second copy
                ref_hidden = self.reference.forward_hidden(**b.forward_kwargs(self.routing_replay)).hidden
                ref_logprobs = response_logprobs(self.reference, ref_hidden, b, self.temperature)
            k3 = reference_kl(x.logprobs, ref_logprobs) * b.mask
            loss = loss + s.kl_ref_coef * (k3 * keep).sum() / rows.num_tokens
            metrics["rl/kl_ref"] = float(k3.detach().sum() / b.mask.sum().clamp_min(1.0))
        return LossTerms(loss, sums={"rl/loss": float(loss.detach())}, means={**metrics, **entropy})

    def __call__(self, model: Decoder, b: PackedBatch, rows: TrainBatch, upcoming: TrainBatch | None) -> LossTerms:
        if self.routing_replay and not b.has_routing:
            raise ValueError("routing_replay is on but the samples carry no routing trace")
        hidden, indexer_kl = _forward_hidden(model, b, self.routing_replay, self.stage.activation_checkpointing)
        terms = self.policy_terms(model, hidden, b, rows, self.keep(b))
        terms.indexer_kl = indexer_kl
        return terms

    def step_metrics(self) -> StepMetrics:
        return StepMetrics()


class OPDObjective(GRPOObjective):
    """Full-vocabulary reverse KL to each row's teacher (seed §5.2.4), optionally plus the GRPO loss."""

    pads = False  # the teachers read the packed ids; their position limits are their own
    packs = False  # the teachers read the rows padded (their own forwards): the student's stays padded too

    def __init__(self, stage: OPDStage, *, model: Decoder, temperature: float, current_version: int, pool,
                 reference: Decoder | None = None):
        super().__init__(stage, model=model, temperature=temperature, current_version=current_version, reference=reference)
        self.stage: OPDStage = stage
        self.pool = pool
        self.kl_sum, self.kl_tokens = 0.0, 0.0  # Σ KL and the tokens it is over, this step
        self.teachers_seen: set[str] = set()

    def __call__(self, model: Decoder, b: PackedBatch, rows: TrainBatch, upcoming: TrainBatch | None) -> LossTerms:
        s = self.stage
        out = model.forward_hidden(b.input_ids, routing_replay=b.routing, checkpoint_layers=s.activation_checkpointing)
        keep = self.keep(b)
        weights = b.mask * keep
        terms = LossTerms(torch.zeros((), device=b.input_ids.device))
        if s.kl_weight > 0:
            kl = self.kl_terms(model, out.hidden, b, rows, weights, upcoming)
            terms.loss = terms.loss + s.kl_weight * kl
            terms.sums["opd/kl_loss"] = float(kl.detach())
        if s.rl_weight > 0:
            rl = self.policy_terms(model, out.hidden, b, rows, keep)
            terms.loss = terms.loss + s.rl_weight * rl.loss
            terms.sums.update(rl.sums)
            terms.means.update(rl.means)
        return terms

    def kl_terms(self, model: Decoder, hidden: torch.Tensor, b: PackedBatch, rows: TrainBatch, weights: torch.Tensor,
                 upcoming: TrainBatch | None) -> torch.Tensor:
        """Σ over teachers of the reverse KL of their rows (each ÷ the step's tokens); counts KL per teacher."""
        s, head = self.stage, model.lm_head.weight
        by_teacher: dict[str, list[int]] = defaultdict(list)
        for j, name in enumerate(rows.teachers_B):
            by_teacher[name].append(j)
        index = {name: torch.tensor(r, device=b.input_ids.device) for name, r in by_teacher.items()}

        def score(name, teacher_out):
            r = index[name]
            kl_loss, kl_tok = reverse_kl_loss(hidden[r], head, teacher_out.hidden.to(hidden.dtype),
                                              teacher_out.head_weight.to(head.dtype), weights=weights[r],
                                              normalizer=rows.num_tokens, impl=s.kl_impl, chunk_size=s.kl_chunk_size)
            self.kl_sum += float(kl_tok.sum())
            self.kl_tokens += float(weights[r].sum())
            self.teachers_seen.add(name)
            return kl_loss

        # the pool starts copying the next micro-batch's first missing teacher once this one's are in
        ahead = list(dict.fromkeys(upcoming.teachers_B)) if upcoming is not None else []
        return sum(self.pool.run({name: b.input_ids[r] for name, r in index.items()}, score, next_teachers=ahead).values())

    def step_metrics(self) -> StepMetrics:
        pool = self.pool.stats().as_metrics()
        teachers = pool.pop("teachers/teachers", None)
        pool.pop("teachers/overhead", None)  # a ratio of summed counters: recomputed after merging ranks
        shared = {"opd/teachers_in_step": float(len(self.teachers_seen))}
        if teachers is not None:
            shared["teachers/teachers"] = teachers
        return StepMetrics(sums={"opd/kl_sum": self.kl_sum, "opd/kl_tokens": self.kl_tokens, **pool}, shared=shared)


OBJECTIVES: dict[str, type] = {"sft": SFTObjective, "grpo": GRPOObjective, "opd": OPDObjective}
"""Objective class by stage `type`."""


def build_objective(stage: SFTStage | GRPOStage | OPDStage, *, model: Decoder, temperature: float,
                    current_version: int, pool=None, reference: Decoder | None = None):
    """The objective of a stage, with the worker's runtime handles (the model, its teacher pool, the
    frozen reference policy)."""
    return OBJECTIVES[stage.type](stage, model=model, temperature=temperature, current_version=current_version, pool=pool,
                                  reference=reference)

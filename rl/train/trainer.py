"""The trainer: one optimizer step on one rank's share of a batch, through one micro-batch loop that every
objective (SFT, GRPO, OPD: rl/train/objectives.py) plugs into.

The trainer owns the optimizer and updates the policy's weights in place; the engine holds the same
module (colocated), so after a step the next rollout token already uses the new weights. A step sorts
the rank's rows by length (micro-batches of similar length waste little padding), packs each
micro-batch, asks the objective for its loss, adds the CSA2 indexer KL and backpropagates; gradients are
summed across ranks by the data-parallel strategy (rl/train/parallel.py: DDP's bucketed all-reduce during the
last micro-batch's backward, or FSDP2's reduce-scatter), then the trainer clips and steps. Every loss is
normalised by the *global* number of response tokens of the step (`TrainBatch.num_tokens`), so summing
gradients over micro-batches and ranks gives exactly the gradient of one big batch.

CSA2 models (seed §2.3) add the indexer KL (seed §3.1.2) to each micro-batch's loss, weighted by
`sparse_attention.aux_loss_weight` and by the micro-batch's share of the global response tokens, so the
added term is the token-weighted mean over the batch (summed across ranks, like the policy loss). Its
gradient reaches only the indexer; it is logged as `train/indexer_kl`.

Metrics come back as `StepMetrics` (sums, token-weighted means, values equal on every rank); the
controller merges the ranks' with `merge_step_metrics`.

A step whose loss or gradient norm is not finite is not applied: `apply` raises `Diverged` before the optimizer
steps, so NaN never reaches the weights, the AdamW moments or a checkpoint (a finite lr of 1e30 trains NaN from the
second step). The check reads only values already on the host (the loss metrics every objective returns as floats,
the clipped norm): no extra device sync. The gradient norm is the all-reduced gradient's, equal on every rank, so a
NaN on any rank stops every rank at the same step (a rank whose own loss alone is not finite stops alone: the
optimizer step it skips holds no collective that another rank would wait in).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np
import torch

from model.decoder import Decoder, is_dtensor
from model.varlen import PackedSequences
from rl.config import PACKED_TOKENS_CUDA, OptimConfig
from rl.train.parallel import Single, idle_loss
from rl.types import Sample


class Diverged(ArithmeticError):
    """The training diverged: a step's loss or gradient norm is not finite. Raised before the optimizer step, so
    the weights, the optimizer state and the LR schedule are the last good step's. `reason` says what was not
    finite; the job (rl/algo/driver.py) raises it again with the global `step` and a `hint` (the last good
    checkpoint, how to resume), and `rl train` prints it as one line and exits 5."""

    def __init__(self, reason: str, step: int | None = None, hint: str = ""):
        super().__init__((f"step {step}: " if step is not None else "") + reason + (f"; {hint}" if hint else ""))
        self.reason, self.step, self.hint = reason, step, hint

    def __reduce__(self):  # crosses from a Ray worker with its fields
        return type(self), (self.reason, self.step, self.hint)


LOSS_METRICS = ("sft/loss", "rl/loss", "opd/kl_loss", "train/indexer_kl")
"""The loss terms objectives report as host floats (`LossTerms.sums`/`means`): what `Diverged` names when the
gradient norm is not finite because the loss is not."""


def divergence(grad_norm: float, metrics: "StepMetrics") -> str | None:
    """Why a step must not be applied (None: it may): its loss is not finite, or its gradient norm is not."""
    losses = {k: v for part in (metrics.sums, metrics.means) for k, v in part.items() if k in LOSS_METRICS}
    bad = {k: v for k, v in losses.items() if not math.isfinite(v)}
    if bad:
        key, value = next(iter(bad.items()))
        return f"the loss is not finite ({value}, {key})"
    if not math.isfinite(grad_norm):
        said = ", ".join(f"{v:.4g}" for v in losses.values())
        return f"the gradient norm is {grad_norm}" + (f" (the loss is finite: {said})" if said else "")
    return None


@dataclass
class PackedBatch:
    """Right-padded teacher-forcing batch; position t predicts targets[:, t] from input_ids[:, :t+1].

    With `packed` set, the forward runs on the rows laid back to back instead (`flat_ids` [1, N], N the real tokens,
    positions restarting per row, document-masked attention: model/varlen.py), and the [B, T] tensors stay the
    losses' view of the same tokens: `at` reads the forward's output at [B, T] positions."""

    input_ids: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1.0 on response targets
    behavior_logprobs: torch.Tensor  # [B, T] (zeros off the response)
    routing: torch.Tensor | None = None  # [B, T, L, k] recorded expert ids of each input token
    versions: torch.Tensor | None = None  # [B, T] policy version of each response target token
    lengths: torch.Tensor | None = None  # [B] real (unpadded) tokens of each row of input_ids
    packed: PackedSequences | None = None  # set: the forward's layout is the packed one below
    flat_ids: torch.Tensor | None = None  # [1, N] the rows' input ids back to back
    flat_routing: torch.Tensor | None = None  # [1, N, L, k] (replacing `routing`, which stays None)

    def forward_kwargs(self, routing: bool) -> dict:
        """`Decoder.forward_hidden`'s input for this batch's layout (`routing`: replay the recorded expert ids)."""
        if self.packed is None:
            return {"input_ids": self.input_ids, "routing_replay": self.routing if routing else None}
        return {"input_ids": self.flat_ids, "positions": self.packed.positions(self.flat_ids.device),
                "packed": self.packed, "routing_replay": self.flat_routing if routing else None}

    @property
    def has_routing(self) -> bool:
        return self.routing is not None or self.flat_routing is not None

    def at(self, out: torch.Tensor, idx: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The forward's output [B, T, ...] (or [1, N, ...] packed) at the [B, T] positions `idx` (row, t)."""
        if self.packed is None:
            return out[idx]
        return out[0, self.packed.cu_seqlens[:-1].long()[idx[0]] + idx[1]]

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """The forward's output as [B, T, ...] (zeros on padding): as is unpacked."""
        if self.packed is None:
            return out
        real = self.token_mask().nonzero(as_tuple=True)
        return out.new_zeros(*self.input_ids.shape, *out.shape[2:]).index_put(real, self.at(out, real))

    def token_mask(self) -> torch.Tensor:
        """[B, T] bool: True on real tokens, False on right padding (all True without `lengths`)."""
        T = self.input_ids.shape[1]
        if self.lengths is None:
            return torch.ones_like(self.input_ids, dtype=torch.bool)
        return torch.arange(T, device=self.input_ids.device) < self.lengths[:, None]


SEQ_BUCKET_CUDNN = 64
"""With cuDNN's attention kernels allowed in training (`Trainer(cudnn_attention=True)`), the trainer pads each
micro-batch's length up to a multiple of this (`Trainer.seq_bucket`): cuDNN builds an execution graph for every new
shape, ~40 ms for the forward and again for the backward on an H200, once per process, and a fresh Ray actor whose
micro-batches of a long-tail workload nearly all have lengths it has not seen spent ~0.65 s of a ~1.7 s step on them;
in buckets of 64 a 512-token recipe has at most 8 lengths. Flash attention, which the CUDA trainer takes by default
(`forward_context`), builds nothing per shape, and padding would only add work: with a new batch every step,
unpadded flash 818 ms a step, padded flash 911, padded cuDNN 941, unpadded cuDNN 1,082 (BENCHMARKS.md, "The actor's
train step"). So by default the trainer does not pad."""


def forward_context(device: str | torch.device, autocast: torch.dtype | None = None,
                    cudnn_attention: bool = False) -> contextlib.ExitStack:
    """The training forward's context: autocast to `autocast` (mixed precision: the master weights stay the
    model's dtype), and on CUDA SDPA restricted to flash, memory-efficient and math kernels unless
    `cudnn_attention` (`SEQ_BUCKET_CUDNN` says why). The backward takes the kernel its forward took."""
    kind = torch.device(device).type
    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.autocast(kind, dtype=autocast or torch.float32, enabled=autocast is not None))
    if kind == "cuda" and not cudnn_attention:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
    return ctx


def padded_length(T: int, pad_to: int = 1, max_len: int | None = None) -> int:
    """`T` rounded up to a multiple of `pad_to`, but not past `max_len` (the model's positions); never below `T`."""
    if pad_to <= 1:
        return T
    up = -(-T // pad_to) * pad_to
    return max(T, min(up, max_len)) if max_len is not None else up


def pack(prompts_B: Sequence[Sequence[int]], responses_B: Sequence[Sequence[int]],
         behavior_B: Sequence[Sequence[float]] | None = None, routing_B: Sequence | None = None,
         versions_B: Sequence[Sequence[int]] | None = None, device: str | torch.device = "cpu",
         loss_masks_B: Sequence[Sequence[int] | None] | None = None, pad_to: int = 1,
         max_len: int | None = None, packed: bool = False) -> PackedBatch:
    """`loss_masks_B`: per response token 1 (trained) or 0 (a tool's output, appended, not sampled); None: all 1.
    `pad_to`, `max_len`: the padded length, `padded_length` of the longest row's. `packed`: the forward's layout is
    the rows back to back (`PackedBatch.packed`; `pad_to` does not apply)."""
    if packed:
        pad_to = 1
    seqs = [list(p) + list(r) for p, r in zip(prompts_B, responses_B)]
    B, T = len(seqs), padded_length(max(len(s) for s in seqs) - 1, pad_to, max_len)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    behav = torch.zeros(B, T)
    versions = torch.zeros(B, T, dtype=torch.long) if versions_B is not None else None
    routing = None
    lengths = [len(s) - 1 for s in seqs]
    starts = np.concatenate([[0], np.cumsum(lengths)]) if packed else None
    for i, (s, p, r) in enumerate(zip(seqs, prompts_B, responses_B)):
        n = len(s) - 1
        input_ids[i, :n] = torch.tensor(s[:-1])
        targets[i, :n] = torch.tensor(s[1:])
        P, R = len(p), len(r)
        mask[i, P - 1 : P - 1 + R] = 1.0 if loss_masks_B is None or loss_masks_B[i] is None else \
            torch.tensor(loss_masks_B[i], dtype=torch.float32)
        if behavior_B is not None:
            behav[i, P - 1 : P - 1 + R] = torch.tensor(behavior_B[i], dtype=torch.float32)
        if versions is not None:
            versions[i, P - 1 : P - 1 + R] = torch.tensor(versions_B[i], dtype=torch.long)
        if routing_B is not None and routing_B[i] is not None:
            tr = torch.tensor(routing_B[i], dtype=torch.long)  # a copy: arrays from Ray are read-only
            if routing is None:
                routing = torch.zeros(1 if packed else B, int(starts[-1]) if packed else T, *tr.shape[1:],
                                      dtype=torch.long)
            n = min(tr.shape[0], lengths[i])  # a trace covers the input tokens (its last token's ids are unused)
            if packed:
                routing[0, starts[i] : starts[i] + n] = tr[:n]
            else:
                routing[i, : tr.shape[0]] = tr
    out = PackedBatch(*(t.to(device) for t in (input_ids, targets, mask, behav)),
                      versions=None if versions is None else versions.to(device),
                      lengths=torch.tensor(lengths, device=device))
    if not packed:
        out.routing = None if routing is None else routing.to(device)
        return out
    out.packed = PackedSequences.from_lengths(lengths, device)
    out.flat_ids = input_ids[out.token_mask().cpu()][None].to(device)  # row-major: the rows back to back
    out.flat_routing = None if routing is None else routing.to(device)
    return out


@dataclass(frozen=True)
class TrainBatch:
    """One rank's rows of one optimizer step (picklable: it crosses to the worker). Per-row lists, `_B`."""

    prompts_B: Sequence[Sequence[int]]
    responses_B: Sequence[Sequence[int]]
    num_tokens: float
    """Normaliser of every loss term: response tokens of the whole step, over all ranks."""
    behavior_logprobs_B: Sequence[Sequence[float]] | None = None
    versions_B: Sequence[Sequence[int]] | None = None
    routing_B: Sequence[np.ndarray | None] | None = None
    advantages_B: Sequence[float] | None = None
    teachers_B: Sequence[str] | None = None
    """OPD: the teacher that scores each row."""
    loss_masks_B: Sequence[Sequence[int]] | None = None
    """Multi-turn rows: 1 per sampled response token, 0 per tool-output token (`Sample.loss_mask_T`); None: all 1."""

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], advantages_B: Sequence[float], num_tokens: float,
                     teachers_B: Sequence[str] | None = None) -> "TrainBatch":
        masks = [s.loss_mask_T() for s in samples] if any(s.turns for s in samples) else None
        return cls([s.prompt_tokens for s in samples], [s.response_tokens for s in samples], num_tokens,
                   [s.behavior_logprobs_T for s in samples], [s.policy_versions_T for s in samples],
                   [s.routing_trace for s in samples], list(advantages_B), teachers_B, masks)

    def __len__(self) -> int:
        return len(self.prompts_B)

    @property
    def sequence_tokens(self) -> int:
        """Prompt and response tokens of every row: what a forward/backward processes."""
        return sum(len(p) + len(r) for p, r in zip(self.prompts_B, self.responses_B))

    @property
    def response_tokens(self) -> float:
        return float(sum(len(r) for r in self.responses_B))

    def select(self, idx: Sequence[int]) -> "TrainBatch":
        """The rows `idx`, in that order (the normaliser stays the step's)."""
        pick = {f.name: (None if (v := getattr(self, f.name)) is None else [v[i] for i in idx])
                for f in fields(self) if f.name.endswith("_B")}
        return TrainBatch(num_tokens=self.num_tokens, **pick)

    def pack(self, device: str | torch.device, routing: bool = False, pad_to: int = 1,
             max_len: int | None = None, packed: bool = False) -> PackedBatch:
        return pack(self.prompts_B, self.responses_B, self.behavior_logprobs_B,
                    routing_B=self.routing_B if routing else None, versions_B=self.versions_B, device=device,
                    loss_masks_B=self.loss_masks_B, pad_to=pad_to, max_len=max_len, packed=packed)


@dataclass
class LossTerms:
    """What an objective returns for one micro-batch."""

    loss: torch.Tensor
    """Scalar to backpropagate, already ÷ the step's global token count."""
    sums: dict[str, float] = field(default_factory=dict)
    """Metrics that add up over micro-batches and ranks (loss terms ÷ global tokens, counts)."""
    means: dict[str, float] = field(default_factory=dict)
    """Per-token means over this micro-batch's response tokens."""
    indexer_kl: torch.Tensor | None = None
    """CSA2: the micro-batch's indexer KL (the trainer adds it, weighted)."""


class Objective(Protocol):
    """A training loss over micro-batches (rl/train/objectives.py)."""

    micro_batch_size: int | None
    """Rows per forward/backward; None: the whole shard at once."""
    micro_batch_tokens: int | None
    """Tokens per forward/backward at most (padded ones included unless packed); set, it replaces
    micro_batch_size (`micro_batches`)."""
    packing: str
    """The stage's `packing` (rl/config.py): "auto", "packed" or "padded" (`Trainer.packs` decides)."""
    tokens_by_default: bool
    """Packed on CUDA with neither micro-batch field set: micro-batches of `PACKED_TOKENS_CUDA` tokens."""
    routing_replay: bool
    """Pack the rows' recorded routing traces for the forward to replay (MoE, seed §5.2.1)."""
    pads: bool
    """The trainer may pad micro-batches past their longest row (`Trainer.seq_bucket`): False where another
    model reads the packed ids and its position limit is not the policy's (OPD teachers)."""

    def __call__(self, model: Decoder, b: PackedBatch, rows: TrainBatch, upcoming: TrainBatch | None) -> LossTerms:
        """The micro-batch's loss; `upcoming`: the next micro-batch's rows, for prefetching (OPD teachers)."""
        ...

    def step_metrics(self) -> "StepMetrics":
        """Metrics of the whole step, after the last micro-batch (e.g. the teacher pool's counters)."""
        ...


@dataclass
class StepMetrics:
    """One rank's metrics of one step, in a form that merges across ranks (`merge_step_metrics`)."""

    sums: dict[str, float] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    """This rank's response tokens: the weight of its means."""
    shared: dict[str, float] = field(default_factory=dict)
    """Equal on every rank (the gradient norm and learning rate after the all-reduce); rank 0's is kept."""

    def add(self, terms: LossTerms | "StepMetrics", tokens: float, scale: float = 1.0) -> None:
        """Merge one micro-batch's terms (or a mini-batch's metrics): sums add (x `scale`), means are weighted
        by response tokens."""
        for k, v in terms.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * scale
        total = self.tokens + tokens
        for k, v in terms.means.items():  # running token-weighted mean
            self.means[k] = (self.means.get(k, 0.0) * self.tokens + v * tokens) / max(total, 1e-12)
        self.tokens = total

    def add_step(self, step: "StepMetrics") -> None:
        """An objective's whole-step counters (`Objective.step_metrics`): sums add, shared values are set."""
        for k, v in step.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.shared.update(step.shared)


RATIOS = {"opd/kl_per_token": ("opd/kl_sum", "opd/kl_tokens"),
          "teachers/overhead": ("teachers/load_wait_s", "teachers/compute_s")}
"""Metrics that are ratios of two summed metrics, computed after merging."""


def timed_train_step(policy, batches: Sequence[TrainBatch] | Sequence[Sequence[TrainBatch]], stage) -> dict[str, float]:
    """`policy.train_step(batches, stage)` (one batch, or one list of mini-batches, per rank), merged, with the
    step's training throughput `train/tokens_per_s`: prompt + response tokens of all ranks over the step's
    wall-clock seconds."""
    t0 = time.perf_counter()
    metrics = merge_step_metrics(policy.train_step(batches, stage))
    rows = [b for rank in batches for b in ([rank] if isinstance(rank, TrainBatch) else rank)]
    metrics["train/tokens_per_s"] = sum(b.sequence_tokens for b in rows) / max(time.perf_counter() - t0, 1e-9)
    return metrics


def merge_step_metrics(parts: Sequence[StepMetrics]) -> dict[str, float]:
    """One step's metrics from every data-parallel rank's: sums add, means are weighted by each rank's
    response tokens, shared values are rank 0's, and the `RATIOS` are taken of the merged sums."""
    out = dict(parts[0].shared)
    total = sum(p.tokens for p in parts)
    for p in parts:
        for k, v in p.sums.items():
            out[k] = out.get(k, 0.0) + v
    for k in parts[0].means:
        out[k] = sum(p.means.get(k, 0.0) * p.tokens for p in parts) / max(total, 1e-12)
    for name, (num, den) in RATIOS.items():
        if num in out and den in out:
            out[name] = out[num] / out[den] if out[den] > 0 else 0.0
    return out


def lr_factor(cfg: OptimConfig, step: int, total_steps: int | None) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up over warmup_steps, then
    constant or cosine decay to 0 at total_steps."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.schedule == "cosine" and total_steps:
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    return warm


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig,
                    total_steps: int | None = None) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA (model/lora.py): the adapters alone
    # one fused kernel for the whole update on CUDA (torch's default there is the multi-tensor foreach loop);
    # FSDP2's sharded parameters (DTensors) keep the default
    fused = bool(params) and all(p.is_cuda and not is_dtensor(p) for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step, total_steps))
    return opt, sched


def by_length(batch: TrainBatch) -> list[int]:
    """Row order for micro-batching: similar lengths together (padding to the longest wastes little)."""
    return sorted(range(len(batch)), key=lambda i: len(batch.prompts_B[i]) + len(batch.responses_B[i]))


def micro_batches(batch: TrainBatch, rows: int | None, tokens: int | None, packed: bool = False) -> list[list[int]]:
    """The rows of each micro-batch, shortest first: `rows` at a time (None: all), or with `tokens`, as many
    consecutive rows as keep the micro-batch's tokens within `tokens` (at least one row): rows × the longest one's
    tokens (its padded size), or with `packed` the rows' own tokens summed (no padding is computed)."""
    order = by_length(batch)
    if tokens is None:
        size = rows or max(len(order), 1)
        return [order[lo : lo + size] for lo in range(0, len(order), size)]
    return split_to_cap(batch, order, tokens, packed)


def split_to_cap(batch: TrainBatch, rows: list[int], cap: int, packed: bool) -> list[list[int]]:
    """`rows` (ascending lengths, as `micro_batches` gives them) in consecutive parts whose computed tokens stay
    within `cap` (at least one row each): the rows' own tokens packed, rows × the longest padded."""
    parts: list[list[int]] = []
    used = 0
    for i in rows:  # ascending lengths: the row joining a part is its longest
        length = len(batch.prompts_B[i]) + len(batch.responses_B[i]) - 1  # the packed row (rl/trainer.pack)
        size = used + length if packed else (len(parts[-1]) + 1) * length if parts else length
        if parts and size <= cap:
            parts[-1].append(i)
            used = size
        else:
            parts.append([i])
            used = length
    return parts




class StepClock:
    """Where a train step's time goes, without a host sync inside the step: on CUDA a timing event is recorded at
    each mark and read once at the end (`seconds`); elsewhere the host clock. The time between two marks is
    charged to the later mark's name: `forward` (packing the rows, the forward and the loss), `backward`,
    `optimizer` (clipping and the AdamW step)."""

    def __init__(self, device: str | torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        """{"train/<name>_s": seconds} summed over the step's intervals."""
        if self.cuda:
            self.marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[f"train/{name}_s"] = out.get(f"train/{name}_s", 0.0) + dt
        return out


class Trainer:
    def __init__(self, model: Decoder, optim: OptimConfig, device: str | torch.device = "cpu", total_steps: int | None = None,
                 autocast: torch.dtype | None = None, parallel: Single | None = None, seq_bucket: int | None = None,
                 cudnn_attention: bool = False, packing: str | None = None):
        """total_steps: the stage's optimizer steps (the cosine schedule decays over them). autocast: the
        forward's compute dtype under mixed precision (master weights, gradients and AdamW stay the model's).
        parallel: the data-parallel strategy over `model` (rl/train/parallel.py; default: one rank)."""
        self.model, self.optim_cfg, self.device, self.autocast = model, optim, device, autocast
        self.cudnn_attention = cudnn_attention
        """On CUDA, whether training attention may take cuDNN's SDPA kernels (PyTorch's first choice on an H200);
        by default flash attention (`forward_context`)."""
        self.seq_bucket = seq_bucket if seq_bucket is not None else (
            SEQ_BUCKET_CUDNN if torch.device(device).type == "cuda" and cudnn_attention else 1)
        """Micro-batch lengths are padded up to a multiple of this (`SEQ_BUCKET_CUDNN` says when and why), for
        objectives that allow it (`Objective.pads`)."""
        self.packing = packing
        """Overrides the objectives' `packing` ("packed" / "padded"; None: theirs), for benchmarks and tests."""
        self.parallel = parallel if parallel is not None else Single(model)
        self.opt, self.sched = build_optimizer(model, optim, total_steps)
        self.clock: StepClock | None = None
        """The running `train_step`'s clock (None between steps and in a bare `accumulate`)."""
        self.token_cap: int | None = None
        """The most tokens (computed: packed, or rows × the longest padded) one micro-batch may hold, whatever the
        stage's micro-batch fields say (rl/runtime/memory.py `token_cap`: what the device has left for activations;
        the worker sets it on CUDA). A micro-batch over it is split; the gradient is the same. None: no cap."""

    def packs(self, objective: Objective) -> bool:
        """Whether `objective`'s micro-batches run packed (model/varlen.py): `packing` "packed", or "auto" on CUDA;
        never for CSA2 models (their compressed entries and indexer span a whole row) or objectives whose other
        models read the padded rows (`Objective.packs`: OPD's teachers)."""
        mode = self.packing or getattr(objective, "packing", "padded")
        if self.model.config.is_sparse or not getattr(objective, "packs", False) or mode == "padded":
            return False
        return mode == "packed" or torch.device(self.device).type == "cuda"

    def micro_batch_plan(self, batch: TrainBatch, objective: Objective) -> tuple[list[list[int]], bool]:
        """(the rows of each micro-batch, packed or not)."""
        packed = self.packs(objective)
        tokens = objective.micro_batch_tokens
        if tokens is None and packed and getattr(objective, "tokens_by_default", False) and \
                torch.device(self.device).type == "cuda":
            tokens = PACKED_TOKENS_CUDA
        plan = micro_batches(batch, objective.micro_batch_size, tokens, packed)
        if self.token_cap is not None:
            plan = [part for rows in plan for part in split_to_cap(batch, rows, self.token_cap, packed)]
        return plan, packed

    def train_step(self, batch: TrainBatch | Sequence[TrainBatch], objective: Objective) -> StepMetrics:
        """One optimizer step on this rank's rows: `accumulate` the gradient, then `apply` it. A list of batches
        (PPO mini-batches, `GRPOStage.mini_batches`; every rank gets as many) takes one optimizer step each, in
        order; the merged metrics weigh each mini-batch's loss terms by its share of the step's normaliser
        (so `rl/loss` is the step's loss as without mini-batches), its means by its tokens, and report the mean
        gradient norm and the last learning rate."""
        batches = [batch] if isinstance(batch, TrainBatch) else list(batch)
        total = sum(b.num_tokens for b in batches)
        metrics, norms = StepMetrics(), []
        self.clock = StepClock(self.device)
        try:
            for b in batches:
                part = self.accumulate(b, objective, step_end=False)
                norms.append(self.apply(part))
                metrics.add(part, part.tokens, scale=b.num_tokens / total if total > 0 else 1.0)
            metrics.shared.update(self.clock.seconds())
        finally:
            self.clock = None
        metrics.add_step(objective.step_metrics())  # the objective's counters of the whole step, once
        metrics.shared["train/grad_norm"] = sum(norms) / len(norms)
        metrics.shared["train/lr"] = self.sched.get_last_lr()[0]
        if len(batches) > 1:
            metrics.shared["train/optimizer_steps"] = len(batches)
        return metrics

    def accumulate(self, batch: TrainBatch, objective: Objective, step_end: bool = True) -> StepMetrics:
        """The micro-batch loop: add this rank's share of the step's gradient to `.grad` (summed over the ranks
        once the last micro-batch's backward is done). Every rank runs as many micro-batches as the rank with
        the most; the extra ones are zero-weight (`idle_loss`, rl/train/parallel.py says why). `step_end`: add the
        objective's whole-step counters (`Objective.step_metrics`); `train_step` adds them once itself."""
        self.model.train()
        plan, packed = self.micro_batch_plan(batch, objective)
        micro = [batch.select(rows) for rows in plan]
        count = self.parallel.micro_batches(len(micro))
        metrics = StepMetrics()
        aux_weight = self.model.config.sparse_attention.aux_loss_weight if self.model.config.is_sparse else 0.0
        def loss_of(k: int):
            def run(model: Decoder) -> tuple[torch.Tensor, tuple[LossTerms, float] | None]:
                if k >= len(micro):
                    with forward_context(self.device, self.autocast, self.cudnn_attention):
                        return idle_loss(model, self.device), None
                rows = micro[k]
                b = rows.pack(self.device, routing=objective.routing_replay,
                              pad_to=self.seq_bucket if objective.pads else 1,
                              max_len=self.model.config.max_position_embeddings, packed=packed)
                with forward_context(self.device, self.autocast, self.cudnn_attention):
                    terms = objective(model, b, rows, micro[k + 1] if k + 1 < len(micro) else None)
                if self.clock is not None:
                    self.clock.mark("forward")
                tokens = float(b.mask.sum())
                loss = terms.loss
                if terms.indexer_kl is not None:
                    # aux_loss_weight · (this micro-batch's share of the global response tokens) · indexer KL
                    loss = loss + aux_weight * tokens / max(batch.num_tokens, 1.0) * terms.indexer_kl
                    terms.means["train/indexer_kl"] = float(terms.indexer_kl.detach())
                return loss, (terms, tokens)
            return run

        for k in range(count):
            done = self.parallel.backward(loss_of(k), last=k == count - 1)
            if self.clock is not None:
                self.clock.mark("backward" if done is not None else "idle")
            if done is not None:
                metrics.add(*done)
        if step_end:
            metrics.add_step(objective.step_metrics())
        return metrics

    def apply(self, metrics: StepMetrics | None = None) -> float:
        """Clip the (rank-summed) gradient, step the optimizer and the LR schedule; returns the grad norm. A
        non-finite gradient norm, or loss in `metrics` (the accumulated step's), raises `Diverged` instead, the
        gradient dropped and nothing stepped."""
        gnorm = self.parallel.clip_grad_norm(self.optim_cfg.grad_clip)
        if (reason := divergence(gnorm, metrics or StepMetrics())) is not None:
            self.opt.zero_grad(set_to_none=True)
            raise Diverged(reason)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.clock is not None:
            self.clock.mark("optimizer")
        return gnorm

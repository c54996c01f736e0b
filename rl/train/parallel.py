"""Data parallelism of the trainer across the PolicyWorkers' process group (torch.distributed: NCCL on GPUs,
gloo on CPU), chosen by `runtime.parallel` (rl/config.py):

- `Single`: one worker; the plain module, no communication.
- `DDP`: every rank holds the whole trainer (weights, gradients, AdamW state); torch's
  DistributedDataParallel all-reduces gradients in buckets while the backward still runs. Micro-batches
  before a step's last accumulate locally (`no_sync`); the last one's backward reduces the sum.
- `FSDP2`: `fully_shard` per decoder layer (per FFN for CSA2 models, see `FSDP2`) and on the root:
  parameters, gradients and AdamW state are sharded over the ranks (each rank keeps 1/N of every tensor),
  a layer's full weights exist only while it runs. run.dtype bfloat16:
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (bf16 compute, fp32 master weights, fp32
  gradient reduction and optimizer state).

The rules every strategy keeps (they are what make two ranks take one rank's step):
- Gradients are SUMMED across ranks, never averaged: every loss term is already ÷ the step's global token
  count (TrainBatch.num_tokens), so the sum over micro-batches and ranks is the gradient of the whole batch.
  DDP and FSDP2 average by default; here DDP reduces through `sum_allreduce` (a comm hook) and FSDP2 is told
  its divide factor is 1 (scaling the loss by the world size instead would also scale the logged loss).
- Every rank runs the same number of micro-batches per step (`micro_batches`: the maximum over ranks). FSDP2
  gathers each layer in every forward and reduce-scatters in every backward, so the ranks must meet for
  each micro-batch; DDP needs one synchronising backward on every rank, also one whose shard is empty. A
  rank with fewer micro-batches runs `idle_loss` ones: one token, loss × 0, so its gradients are unchanged.
- The engine needs full weights after every step (colocated: it decodes on the same device). Under FSDP2
  the engine keeps its own full copy and rl/runtime/worker.py's `refresh_rollout_copy` gathers the shards into it in
  place, on the device; under DDP and Single the trainer's module is full already.

Checkpoints hold full tensors in the same layout whichever strategy wrote them (`full_state_dict`,
`full_optimizer_state`; rank 0 writes), so a run may resume with another strategy or worker count. An FSDP2
rank reads only the rows of each weight it keeps (`FSDP2.load_weights`: safetensors slices), about 1/N of the
file.

`deal_by_length` assigns whole groups to ranks so that every rank has about the same tokens to train.
"""

from __future__ import annotations

import heapq
import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model.checkpoint import write_weights
from model.pretrained import load_weights_into
from model.decoder import Decoder, is_dtensor
from model.lora import is_adapter
from model.pretrained import load_pretrained_into, shard_rows
from rl.checkpoint.format import FileTensor, read_tree
from rl.checkpoint.host_copies import HostCopies

LossFn = Callable[[Decoder], tuple[torch.Tensor, Any]]
"""A micro-batch: the decoder -> (scalar loss to backpropagate, anything the caller wants back)."""


def deal_by_length(costs: Sequence[float], ranks: int) -> list[list[int]]:
    """Indices of `costs` (one per group; a group is never split) dealt to `ranks` so the ranks' summed costs
    are about equal: longest first, each to the rank with the least so far (LPT, within 4/3 of the optimum).
    The cost of a group is its prompt + response tokens: what a forward/backward processes, so ranks with
    equal costs finish the step together instead of all waiting for the longest. Each rank's indices ascend."""
    loads = [(0.0, r) for r in range(ranks)]
    parts: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        parts[r].append(i)
        heapq.heappush(loads, (load + costs[i], r))
    return [sorted(p) for p in parts]


def idle_loss(model: Decoder, device: str | torch.device) -> torch.Tensor:
    """A zero-weight micro-batch (see the module docstring): one token through the policy, loss × 0, so its
    parameters take part in the collectives with zero gradients. The CSA2 indexer loss is left out (over one
    query it may be NaN, and NaN × 0 is NaN); DDP's `find_unused_parameters` and FSDP2's
    `reduce_scatter_unused_params` (torch releases that have it) cover the indexer for sparse models."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    return model.logits(model.forward_hidden(ids).hidden).sum() * 0.0


def sum_allreduce(group, bucket):
    """DDP comm hook (ProcessGroup | None, dist.GradBucket) -> Future[Tensor]: the bucket's gradients summed
    over the ranks (DDP's own hook divides by the world size; our losses are normalised by the global token
    count already). No annotations: DDP checks them against the real classes, and this module's are strings."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _full(t: Any) -> Any:
    """A DTensor gathered to the full tensor on every rank (a collective); anything else as is."""
    return t.full_tensor() if is_dtensor(t) else t


def trainer_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> int:
    """Bytes this rank holds of the trainer's parameters, gradients and optimizer state (only the local
    shard of a DTensor: under FSDP2 about 1/world of a single worker's; DDP and one worker hold it all). A
    trainable parameter's gradient is counted at its parameter's size, as a step holds it (between steps the
    gradients are freed)."""
    def local(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if is_dtensor(t) else t
        return t.numel() * t.element_size()
    params = list(model.parameters())
    states = [v for s in (opt.state.values() if opt is not None else ()) for v in s.values()]
    return sum(local(p) * (2 if p.requires_grad else 1) for p in params) + sum(local(v) for v in states)


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like`: this rank's shard when `like` is a DTensor (every rank holds `full`, so it
    slices locally: no communication), else `full` on like's device and dtype."""
    full = full.to(device=like.device, dtype=like.dtype)
    if is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


class Single:
    """One worker: the plain module."""

    rank, world_size = 0, 1

    def __init__(self, model: Decoder):
        self.model = model

    def micro_batches(self, n: int) -> int:
        return n

    def sync_context(self, last: bool):
        """The context of one micro-batch's forward and backward (`last`: the step's final one)."""
        return nullcontext()

    def forward(self, loss_fn: LossFn) -> tuple[torch.Tensor, Any]:
        return loss_fn(self.model)

    def backward(self, loss_fn: LossFn, last: bool) -> Any:
        """One micro-batch: forward and backward under the strategy's context; returns loss_fn's extra."""
        with self.sync_context(last):
            loss, extra = self.forward(loss_fn)
            loss.backward()
        return extra

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm (over every rank's gradients once reduced); returns it before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))

    # -- checkpoints: full tensors ------------------------------------------------------------------
    def write_weights(self, directory: str | Path, base: Path | None = None) -> None:
        """Rank 0 writes the full weights (model.safetensors + config.json), or a LoRA model's adapters alone and
        `base`'s identity (model/checkpoint.py `write_weights`); every rank must call it."""
        if self.rank == 0:
            write_weights(self.model, directory, base=base)

    def full_state_dict(self, adapters_only: bool = False, host: HostCopies | None = None) -> dict[str, torch.Tensor] | None:
        """The model's state_dict as full CPU tensors of their own on rank 0 (None elsewhere): a snapshot that training
        may go on from (a background checkpoint write); every rank must call it. `adapters_only`: the LoRA adapters
        alone (a frozen 8B base is 16 GB of host copies a checkpoint for nothing). `host`: copied into its reused
        buffers, complete after its `end` (rl/checkpoint/host_copies.py)."""
        if self.rank != 0:
            return None
        return {k: host.tensor(("weights", k), v) if host is not None else v.detach().to("cpu", copy=True)
                for k, v in self.model.state_dict().items() if not adapters_only or is_adapter(k)}

    def load_weights(self, directory: str | Path, base: Path | None = None) -> int | None:
        """The checkpoint's weights into the trainer's module, in place (a LoRA checkpoint on `base`, the file the
        module's frozen weights came from: its adapters alone); returns the tensor bytes read when counted."""
        load_weights_into(self.model, directory, base=base)
        return None

    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict | None:
        """The optimizer's state_dict with full tensors on rank 0 (None elsewhere); every rank must call it."""
        return opt.state_dict() if self.rank == 0 else None

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> int | None:
        """A full optimizer state_dict (its tensors may be `FileTensor`s still in the checkpoint, rl/checkpoint/format.py
        `open_tree`) into `opt`; returns the tensor bytes read when counted."""
        opt.load_state_dict(read_tree(state))
        return None


class DDP(Single):
    """DistributedDataParallel over the default process group (module docstring)."""

    def __init__(self, model: Decoder):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(model)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # the buffers (MoE selection bias) never change in training: no broadcast per forward, which would also
        # be a collective in every no_sync forward (torch 2.13 renamed the switch; older releases, e.g. the GPU
        # image's, know only broadcast_buffers)
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
        self.ddp = DistributedDataParallel(
            _LossModule(model), device_ids=None,  # inputs are placed by the caller
            # a CSA2 indexer takes no gradient in a forward without its loss (OPD, idle micro-batches);
            # dense and MoE layers reach every parameter (stacked experts are one tensor), so they skip the
            # extra graph traversal
            find_unused_parameters=model.config.is_sparse, **no_buffer_sync)
        self.ddp.register_comm_hook(None, sum_allreduce)

    def sync_context(self, last: bool):
        return nullcontext() if last else self.ddp.no_sync()

    def forward(self, loss_fn: LossFn) -> tuple[torch.Tensor, Any]:
        # the whole micro-batch loss runs inside DDP's forward: the objectives call forward_hidden, logits and
        # lm_head.weight, not model(...), and DDP's reducer arms for backward in its forward
        return self.ddp(loss_fn)

    def micro_batches(self, n: int) -> int:
        return _max_over_ranks(n, self.model)


class FSDP2(Single):
    """fully_shard per decoder layer and on the root (module docstring)."""

    def __init__(self, model: Decoder, bf16: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        super().__init__(model)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        # CSA2 layers hand a mutable SharedState down the stack, and FSDP2 rebuilds dataclass arguments that hold
        # tensors needing gradients (a copy: the next layer would not see the writes); there each layer's FFN is
        # the unit (the bulk of its weights) and the attention stays with the root
        units = [layer.mlp if model.config.is_sparse else layer for layer in model.model.layers] + [model]
        for unit in units:  # layers first: the root keeps what no unit holds (embeddings, final norm, head)
            fully_shard(unit, mp_policy=mp)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)  # a sum: the losses carry the global normaliser
            # plain SUM collectives: a divide factor of 1 would otherwise be NCCL's PREMUL_SUM, which gloo lacks
            # (releases without the switch use PREMUL_SUM: fine on NCCL)
            if hasattr(unit, "set_force_sum_reduction_for_comms"):
                unit.set_force_sum_reduction_for_comms(True)
            # a parameter with no gradient on one rank (the CSA2 indexer in an idle micro-batch) still joins
            # the reduce-scatter with zeros, so every rank's collective has the same size
            if hasattr(unit, "set_reduce_scatter_unused_params"):
                unit.set_reduce_scatter_unused_params(True, recurse=False)
        # the objectives call forward_hidden, then logits / lm_head.weight, not model(...): forward_hidden is the
        # root's forward. The root keeps its parameters gathered after its forward (FSDP2 does not reshard the
        # root then), so the head is whole for what follows. logits must not be a forward method too: FSDP2
        # would then run the root's post-backward (reshard, reduce-scatter) as soon as the head's backward is
        # done, before the final norm's and the embedding's, which then read freed memory (an illegal memory
        # access on CUDA, seen on the H200)
        register_fsdp_forward_method(model, "forward_hidden")

    def micro_batches(self, n: int) -> int:
        return _max_over_ranks(n, self.model)

    def write_weights(self, directory: str | Path, base: Path | None = None) -> None:
        state = self.full_state_dict()
        if self.rank == 0:  # no LoRA under FSDP2 (rl validate refuses it): every weight
            write_weights(self.model, directory, state=state)

    def full_state_dict(self, adapters_only: bool = False, host: HostCopies | None = None) -> dict[str, torch.Tensor] | None:
        """The model's state_dict as full CPU tensors on rank 0 (None elsewhere), gathered one tensor at a time."""
        out = {}
        for k, v in self.model.state_dict().items():
            full = _full(v.detach())
            if self.rank == 0:
                # gathered: its own, freed at once (not queued: the gather ran on the collective's stream)
                out[k] = host.tensor(("weights", k), full, queued=False) if host is not None else full.cpu()
        return out if self.rank == 0 else None

    def load_weights(self, directory: str | Path, base: Path | None = None) -> int:
        """Each rank reads only the rows it keeps of each tensor (safetensors slices, model/pretrained.py
        `load_pretrained_into`): about 1/N of the file, whichever strategy or worker count wrote it (full
        tensors), straight into its shards."""
        return load_pretrained_into(self.model, directory)

    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict | None:
        state = opt.state_dict()  # parameter-index keys, as DDP's; the moments are DTensors shaped like params
        out: dict = {}
        for i, s in state["state"].items():  # one tensor gathered at a time; only rank 0 keeps it, on the host
            entry = {}
            for k, v in s.items():
                v = _full(v)
                entry[k] = v.cpu() if torch.is_tensor(v) else v
            if self.rank == 0:
                out[i] = entry
        return {"state": out, "param_groups": state["param_groups"]} if self.rank == 0 else None

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> int:
        """Each moment (a tensor of its parameter's shape) becomes this rank's shard; one still in the checkpoint
        (a `FileTensor`) is read only in this rank's rows. Returns the tensor bytes read from the file."""
        from torch.distributed.tensor import DTensor

        params = [p for g in opt.param_groups for p in g["params"]]
        nbytes = 0

        def shard(v, p: torch.Tensor, what: str):
            nonlocal nbytes
            if isinstance(v, FileTensor) and v.shape == tuple(p.shape) and isinstance(p, DTensor):
                local = v.read(shard_rows(what, p))
                nbytes += local.numel() * local.element_size()
                return DTensor.from_local(local.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(v, FileTensor):  # `step`, a scalar
                v = v.read()
                nbytes += v.numel() * v.element_size()
            return _shard_like(v, p) if torch.is_tensor(v) and v.shape == p.shape else v

        shards = {i: {k: shard(v, params[int(i)], f"optimizer state {i}.{k}") for k, v in s.items()}
                  for i, s in state["state"].items()}
        opt.load_state_dict({"state": shards, "param_groups": read_tree(state["param_groups"])})
        return nbytes


class _LossModule(torch.nn.Module):
    """DDP's module: its forward runs a micro-batch's loss function on the decoder (see `DDP.forward`)."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, loss_fn: LossFn) -> tuple[torch.Tensor, Any]:
        return loss_fn(self.decoder)


def _max_over_ranks(n: int, model: Decoder) -> int:
    t = torch.tensor([n], dtype=torch.long, device=next(model.parameters()).device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def build_data_parallel(kind: str, model: Decoder, *, bf16: bool) -> Single:
    """The `runtime.parallel` strategy for `model` on this rank; Single when no process group of more than one
    rank exists. bf16: run.dtype bfloat16 (FSDP2's mixed-precision policy; DDP and Single use the trainer's
    autocast over float32 master weights)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return Single(model)
    return DDP(model) if kind == "ddp" else FSDP2(model, bf16)

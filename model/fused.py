"""Rollout fusion (issue #15): the engine's no-grad forward in fewer, larger kernels, from the same weights.

A graph-replayed decode step of a small model is bound by its kernel count, not its arithmetic (BENCHMARKS.md,
"Rollout engine": ~22-24 kernels per layer at ~3-4 us each on an H200). A `Decoder` with rollout fusion on
(`Decoder.enable_rollout_fusion`; rollout/graphs.py turns it on for the model it captures) takes, outside
autograd only, a path whose dense layer with a bf16 KV cache is 10 kernels instead of 24 (Qwen3: qk-norm;
22 without it):

    plain  input norm | q, k, v GEMMs (3) | q-norm, k-norm (2) | RoPE q, RoPE k (2) | slot fix-up (3; now 2,
           PagedKVCache.write's masked_fill) + index_copy K, V (2) | attention (2) | o GEMM | residual add |
           post norm | gate, up GEMMs (2) | silu, mul (2) | down GEMM | residual add
    fused  add + input norm | qkv GEMM | q/k-norm + RoPE + K/V cache write | attention (2) | o GEMM |
           add + post norm | gate_up GEMM | silu(gate)·up | down GEMM

- q/k/v (bias included, Qwen2) and gate/up are one GEMM each, over weights concatenated along the output
  dimension (`FusedWeights`): row blocks of one matrix give the same dot products as the separate matrices.
- The residual add and the next RMSNorm are one kernel: the decode loop carries a sublayer's output unadded
  (`h + y`) into the next norm, across layers too (`DecoderLayer.forward_rollout`).
- The Triton kernels (model/kernels/decode_fused.py) run where `use_kernels` says (CUDA); elsewhere the same
  path runs the eager references below, which are the plain forward's own operations.
The training forward never comes here: with autograd on, `Decoder.forward_hidden` is the plain path,
parameter for parameter (same modules, same ops), so training numerics, state_dict, checkpoints, the
optimizer and DDP/FSDP2 see exactly what they saw before.

Keeping the fused weights equal to the parameters. Weights change in place (the optimizer on a shared module,
`refresh_rollout_copy` and checkpoint loads on the engine's copy: rl/runtime/worker.py), so the fused buffers keep
their addresses (captured CUDA graphs read them) and are refreshed in place, in one of two modes:
- share_storage (a frozen model: the worker's bf16 / FSDP2 rollout copy, whose parameters nobody trains):
  each Linear's weight and bias become views of the concatenated buffer, so every in-place update of them
  lands in it: no refresh, no second copy of the weights.
- copy (a trainable module, e.g. the trainer's float32 module that the engine shares): the parameters stay
  untouched (views of one storage would change what the optimizer, DDP/FSDP2 sharding, `state_dict` and a
  safetensors write see: shared storage is refused by safetensors, and FSDP2 re-creates each parameter as
  its own shard) and the buffers are separate copies, refreshed in place after the weights change.
`RolloutFusion.refresh` compares each source parameter's address (with copies: and in-place version counter)
with what the buffers were built from (~10-20 us of host time for a 28-layer model) and copies or re-points
the sources when any of them changed; the decode forward and every graph replay call it first, so a stale
buffer is never read even when a caller forgets the explicit refresh that rl/runtime/worker.py makes after each
weight update. Not covered: writes through `.data`
(they bypass the version counter; nothing here writes weights that way) and replacing a Parameter object
(which would break captured graphs anyway).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.eager_ops import rms_norm_eager, rope_eager

ENABLED = True
"""Decoders with rollout fusion on take the fused path outside autograd (benches set False to compare)."""


GROUPED_EXPERTS = os.environ.get("ASYNCRL_GROUPED_EXPERTS", "1") == "1"
"""MoE layers outside autograd run their routed experts through the grouped kernels of model/kernels/moe.py
(no loop over experts, no host read) where `use_kernels` holds (CUDA): on an H200 a Qwen3-30B-A3B MoE layer
takes 0.64-0.81 ms at decode batches 1-256 against the loop's 1.3-22 ms (bench/moe_decode.py, BENCHMARKS.md).
ASYNCRL_GROUPED_EXPERTS=0 keeps the loop (`ExpertBank.loop`, the reference) for a process."""


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the fused path runs the Triton kernels (compiled, CUDA) or their eager references. The tests
    replace this to run the kernels interpreted on CPU (TRITON_INTERPRET=1) through the whole decoder."""
    return x.is_cuda


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of the rollout path: on CUDA, a few half-precision rows (small-batch decode) through the skinny
    kernel of model/kernels/gemv.py where it was measured faster than cuBLAS for the shape."""
    if x.is_cuda and not torch.is_grad_enabled():
        from model.kernels.gemv import linear as skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# -- eager references of model/kernels/decode_fused.py (the plain forward's own operations) ------------------


def add_rms_norm_eager(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x) · w, residual + x): the decoder's `h = h + y; x = norm(h)`, the sum rounded to
    the dtype before the norm exactly as the plain forward rounds it."""
    h = residual + x
    return rms_norm_eager(h, w, eps), h


def silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] (gate first, as FusedWeights concatenates gate_proj, up_proj) -> silu(gate) · up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def qkv_norm_rope_eager(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                        num_kv_heads: int, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2·KVH)·D] -> q [B, T, H, D], k, v [B, T, KVH, D]: q and k RMSNormed per head (when the
    weights are given, Qwen3) then rotated (RoPE), v as is; the plain Attention.forward's operations."""
    B, T, _ = qkv.shape
    D = cos.shape[-1]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.view(B, T, num_heads, D), k.view(B, T, num_kv_heads, D), v.view(B, T, num_kv_heads, D)
    if q_norm_w is not None:
        q, k = rms_norm_eager(q, q_norm_w, eps), rms_norm_eager(k, k_norm_w, eps)
    return rope_eager(q, cos, sin), rope_eager(k, cos, sin), v


# -- fused weights --------------------------------------------------------------------------------------------


class FusedWeights:
    """The weights (and biases) of several Linears over the same input, concatenated along the output
    dimension in the given order: `F.linear(x, weight, bias).split(splits, -1)` are the Linears' outputs."""

    def __init__(self, linears: Sequence[nn.Linear], share_storage: bool):
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("fused Linears must all have a bias or none")
        self.linears = list(linears)
        self.share_storage = share_storage
        self.splits = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.refresh()

    def sources(self) -> list[torch.Tensor]:
        return [lin.weight for lin in self.linears] + [lin.bias for lin in self.linears if lin.bias is not None]

    @torch.no_grad()
    def refresh(self) -> None:
        """Bring the buffers level with the Linears' parameters, in place where the layout still fits."""
        ws = [lin.weight for lin in self.linears]
        bs = [lin.bias for lin in self.linears if lin.bias is not None]
        self.weight = _fit(self.weight, ws)
        self.bias = _fit(self.bias, bs) if bs else None
        for srcs, buf in ((ws, self.weight), (bs, self.bias)):
            if not srcs:
                continue
            if not self.share_storage:
                torch.cat(srcs, dim=0, out=buf)  # one kernel; the buffer keeps its address
                continue
            for p, view in zip(srcs, buf.split(self.splits, dim=0)):
                if p.data_ptr() != view.data_ptr():  # first time, or the parameter's storage was replaced
                    view.copy_(p)
                    p.data = view  # from now on every in-place update of p writes the fused buffer


def _fit(buf: torch.Tensor | None, srcs: list[torch.Tensor]) -> torch.Tensor:
    """`buf` if it can hold the concatenation of `srcs` (same dtype, device, shape), else a new buffer."""
    ref = srcs[0]
    if any(p.dtype != ref.dtype or p.device != ref.device or p.shape[1:] != ref.shape[1:] for p in srcs):
        raise ValueError("fused Linears must share dtype, device and input width")
    shape = (sum(p.shape[0] for p in srcs), *ref.shape[1:])
    if buf is not None and buf.shape == shape and buf.dtype == ref.dtype and buf.device == ref.device:
        return buf
    return torch.empty(shape, dtype=ref.dtype, device=ref.device)


class RolloutFusion:
    """Every FusedWeights of one Decoder and the signature of their sources at the last refresh."""

    def __init__(self, groups: Sequence[FusedWeights], share_storage: bool):
        self.groups = list(groups)
        self.share_storage = share_storage
        self.params = [p for g in self.groups for p in g.sources()]
        self._seen = self._signature()

    def _signature(self) -> list:
        # shared storage: a source is fresh while it still lives in the buffer (in-place writes land there);
        # copies: while neither its storage nor its in-place version counter changed since the last copy
        if self.share_storage:
            return [p.data_ptr() for p in self.params]
        return [(p.data_ptr(), p._version) for p in self.params]  # noqa: SLF001 - torch's in-place counter

    def refresh(self) -> bool:
        """Copy the sources into the fused buffers if any changed since the last refresh; returns whether."""
        if self._signature() == self._seen:
            return False
        for g in self.groups:  # an optimizer step or a weight refresh changes them all anyway
            g.refresh()
        self._seen = self._signature()
        return True

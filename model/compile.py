"""torch.compile for the training forward (issue #41): the elementwise work around the matmuls fused into Triton
kernels by inductor.

Under bf16 autocast over float32 master weights, a decoder layer's training forward runs its RMSNorms (float32, as
transformers computes them), RoPE, SiLU·up and residual adds as separate eager kernels over [tokens, hidden] float32
tensors, and autograd runs each one's backward as more. On a GPU those passes are memory-bound and cost about as much
as the matmuls at a 0.6B shape. Two modes (`Decoder.compile_for_training`):

- "layers": each dense decoder layer under torch.compile (as torchtitan compiles its transformer blocks): norm, RoPE,
  SwiGLU, residual adds and the casts between them fuse across op boundaries; attention (FlashAttention varlen or
  SDPA) and the matmuls stay library kernels inside the graph. One graph serves every layer (the parameters are
  graph inputs), shapes dynamic, so a new packed length costs no recompilation.
- "ops": only the elementwise functions under torch.compile (`rms_norm_eager`, `rope_eager`, SiLU·up), each with its
  backward: less fusion, but nothing of the layer's control flow is traced (MoE dispatch, CSA2, paged batches).

The arithmetic is the eager path's; the rollout path (model/fused.py) and no-grad forwards never take these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

MODES = ("layers", "ops")

_compiled: dict[tuple[Callable, str], Callable] = {}


def compiled(fn: Callable, backend: str = "inductor") -> Callable:
    """`fn` under torch.compile with dynamic shapes, built once per process and backend."""
    key = (fn, backend)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=True, backend=backend)
    return _compiled[key]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up

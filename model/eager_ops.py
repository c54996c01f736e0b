"""The plain PyTorch forms of RMSNorm and RoPE that the decoder's training forward runs and that the fused Triton
kernels (model/kernels/norm_rope.py, model/kernels/decode_fused.py, through model/fused.py) are checked against:
one module both import, so neither imports the other."""

from __future__ import annotations

import torch


def rms_norm_eager(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 as transformers computes it (the reference of model/kernels/norm_rope.py)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * w.float()).to(x.dtype)


def rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 (the reference of model/kernels/norm_rope.py)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)

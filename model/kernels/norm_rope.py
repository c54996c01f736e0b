"""Fused RMSNorm and RoPE for inference (issue #15): one kernel each where the eager forms take several.

A decode step of a small model is bound by its kernel count, not by its arithmetic: eager RMSNorm is ~6
elementwise kernels (float, pow, mean, add, rsqrt, two muls, cast) and eager rotate-half RoPE ~8 per
tensor (slice, neg, cat, two casts, two muls, add, cast). Each kernel here reads its input once and writes
its output once, computing in float32 exactly what the eager forms compute (model/decoder.py):

    rms_norm(x, w, eps) = (x32 · rsqrt(mean(x32²) + eps) · w32).to(x.dtype)
    rope(x, cos, sin)   = (x32 · cos + rotate_half(x)32 · sin).to(x.dtype),  rotate_half(x) = [−x₂, x₁]

(the sum of squares is reduced in a different order than torch's mean, so results agree to float32
rounding before the cast). The model uses them on CUDA outside autograd (rollout and evaluation);
training keeps the eager forms, which autograd differentiates. `ENABLED = False` turns them off (the
benches compare both). Their plain PyTorch references are the eager forms, `model.decoder.rms_norm_eager`
and `rope_eager`; on CPU the tests run the kernels with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = True
"""The model uses the fused kernels on CUDA outside autograd (model/decoder.py checks this flag)."""


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, ((x * r) * w).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> RMSNorm(x) · w in x.dtype, one program per row."""
    D = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    rows = xc.numel() // D
    if rows:
        _rms_norm_kernel[(rows,)](xc, w.contiguous(), out, D, eps, BLOCK_D=triton.next_power_of_2(D))
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row of x [N, H, D]
    tok = row // H
    d = tl.arange(0, BLOCK)
    m = d < HALF
    base = row * (2 * HALF)
    x1 = tl.load(x_ptr + base + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + d, mask=m, other=0.0).to(tl.float32)
    cb = tok * (2 * HALF)
    c1 = tl.load(cos_ptr + cb + d, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + cb + HALF + d, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + cb + d, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + cb + HALF + d, mask=m, other=0.0)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + d, (x1 * c1 + (-x2) * s1).to(ty), mask=m)
    tl.store(out_ptr + base + HALF + d, (x2 * c2 + x1 * s2).to(ty), mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos, sin [B, T, 1, D] float32 (model.decoder.rope_cos_sin) -> rotated x in x.dtype."""
    B, T, H, D = x.shape
    xc = x.contiguous()
    out = torch.empty_like(xc)
    c = cos.expand(B, T, 1, D).contiguous().float()
    s = sin.expand(B, T, 1, D).contiguous().float()
    if xc.numel():
        _rope_kernel[(B * T * H,)](xc, c, s, out, H, HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2))
    return out

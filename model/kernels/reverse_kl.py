"""Triton kernel for one token chunk of the full-vocabulary OPD loss (seed §5.2.4; issue #6, item 3).

Given the student and teacher logit rows of a chunk, z_s [C, V] and z_t [C, V] (bf16 or fp32, one row
per token, same vocabulary), one launch computes per row

    KL_i = Σ_v p_s(v) (log p_s(v) - log p_t(v))                       (reverse KL, student || teacher)
    g_i  = scale_i · p_s ⊙ (log p_s - log p_t - KL_i)                (d scale_i·KL_i / d z_s)

and writes KL_i (fp32) and g_i (into `grad`, which may be the z_s buffer itself: each program reads a
tile of its own row before it overwrites that tile, so the in-place form is race-free).

One program per row, two sweeps over V in tiles of BLOCK_V:
1. online log-sum-exp of both rows, plus A = Σ_v exp(z_s - m_s)(z_s - z_t) rescaled with the running
   student max, so that KL = A / S_s - (lse_s - lse_t) needs no third sweep (Σ_v p_s = 1);
2. re-read both tiles, form p_s = exp(z_s - lse_s) and g, store g. This sweep runs from the last tile
   back to the first, so its first reads are the tiles sweep 1 just read, still in L2; sweep 1 loads
   with evict_last and sweep 2 loads and stores with evict_first, so what is re-read stays cached longer.
Memory traffic per row: 2 reads of each row + 1 write (the reversed second sweep hits L2 for part of
it). The matmuls that produce z and consume g stay in torch (cuBLAS); `model/reverse_kl.py` drives
them and holds the PyTorch references.
Compiled on a GPU, tl.exp / tl.log are the fast approximate versions (relative error ~1e-6 in fp32);
the parity tests state their tolerances.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reverse_kl_rows_kernel(zs_ptr, zt_ptr, grad_ptr, scale_ptr, kl_ptr, V, stride_s, stride_t, stride_g,
                            BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, REVERSE: tl.constexpr,
                            KEEP: tl.constexpr, DROP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    cols = tl.arange(0, BLOCK_V)

    # sweep 1: running max / sum for both rows and the student-weighted logit gap A
    m_s = -float("inf")
    m_t = -float("inf")
    s_s = 0.0
    s_t = 0.0
    a = 0.0
    for v0 in range(0, V, BLOCK_V):
        live = v0 + cols < V
        x = tl.load(zs_row + v0 + cols, mask=live, other=0.0, eviction_policy=KEEP).to(tl.float32)
        y = tl.load(zt_row + v0 + cols, mask=live, other=0.0, eviction_policy=KEEP).to(tl.float32)
        xm = tl.where(live, x, -float("inf"))  # dead lanes drop out of max and sums, x - y stays 0
        ym = tl.where(live, y, -float("inf"))
        mx = tl.maximum(m_s, tl.max(xm, axis=0))
        my = tl.maximum(m_t, tl.max(ym, axis=0))
        ex = tl.exp(xm - mx)
        alpha = tl.exp(m_s - mx)  # 0 on the first tile (m_s = -inf)
        s_s = s_s * alpha + tl.sum(ex, axis=0)
        a = a * alpha + tl.sum(ex * (x - y), axis=0)
        s_t = s_t * tl.exp(m_t - my) + tl.sum(tl.exp(ym - my), axis=0)
        m_s = mx
        m_t = my
    lse_s = m_s + tl.log(s_s)
    lse_gap = lse_s - (m_t + tl.log(s_t))  # lse_s - lse_t
    kl = a / s_s - lse_gap
    tl.store(kl_ptr + row, kl)

    # sweep 2: g = scale · p_s · ((z_s - z_t) - (lse_s - lse_t) - KL)
    if WRITE_GRAD:
        scale = tl.load(scale_ptr + row).to(tl.float32)
        g_row = grad_ptr + row * stride_g
        n_tiles = tl.cdiv(V, BLOCK_V)
        for i in range(0, n_tiles):
            # REVERSE: last tile first, so the tiles sweep 1 read most recently are re-read from L2
            v0 = (n_tiles - 1 - i) * BLOCK_V if REVERSE else i * BLOCK_V
            live = v0 + cols < V
            x = tl.load(zs_row + v0 + cols, mask=live, other=0.0, eviction_policy=DROP).to(tl.float32)
            y = tl.load(zt_row + v0 + cols, mask=live, other=0.0, eviction_policy=DROP).to(tl.float32)
            p = tl.exp(x - lse_s)
            g = scale * p * ((x - y) - lse_gap - kl)
            tl.store(g_row + v0 + cols, g.to(grad_ptr.dtype.element_ty), mask=live, eviction_policy=DROP)


# H200, bf16, one 512 x 128256 chunk: 0.188 ms (3.5 TB/s of effective traffic, 5 row passes) at 4096 / 8
# warps, the best of block_v {2048, 4096, 8192} x warps {4, 8, 16} (bench/opd_loss.py --kernel-sweep).
# The reversed second sweep: 256 rows 0.129 -> 0.126 ms, 512 rows 0.189 -> 0.186 ms; + L2 hints 0.123 /
# 0.188 ms (2026-11-30; small, kept). A persistent grid (66-264 programs looping over rows) was 1.3-3.7x
# slower: the kernel needs every row in flight to cover memory latency.
BLOCK_V = 4096  # vocab tile; 128256 = 31.3 tiles
NUM_WARPS = 8
REVERSE_SWEEP = True
L2_HINTS = True  # sweep 1 loads evict_last, sweep 2 loads and stores evict_first


def reverse_kl_rows(zs: torch.Tensor, zt: torch.Tensor, scale: torch.Tensor | None = None,
                    grad: torch.Tensor | None = None, block_v: int | None = None,
                    num_warps: int | None = None, out: torch.Tensor | None = None,
                    reverse: bool | None = None, l2_hints: bool | None = None) -> torch.Tensor:
    """Per-row reverse KL of logit rows zs, zt [C, V]; returns KL [C] (fp32).

    With `scale` [C] (fp32) and `grad` [C, V] given, also writes scale_i · dKL_i/dz_s into `grad`
    (`grad` may be `zs` itself). Rows must be contiguous in the last dimension. `out`: a contiguous fp32
    [C] tensor to write KL into (default: a new one). `reverse` (default REVERSE_SWEEP) and `l2_hints`
    (default L2_HINTS) change only the memory access order and cache policy, never the result.
    """
    if zs.shape != zt.shape or zs.dim() != 2:
        raise ValueError(f"expected two [C, V] logit chunks of one shape, got {tuple(zs.shape)} and {tuple(zt.shape)}")
    if zs.stride(-1) != 1 or zt.stride(-1) != 1 or (grad is not None and grad.stride(-1) != 1):
        raise ValueError("logit and gradient rows must be contiguous")
    C, V = zs.shape
    if out is not None and (out.shape != (C,) or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 [{C}] tensor, got {out.dtype} {tuple(out.shape)}")
    kl = torch.empty(C, dtype=torch.float32, device=zs.device) if out is None else out
    if C == 0:
        return kl
    write_grad = grad is not None
    if write_grad and (scale is None or grad.shape != zs.shape):
        raise ValueError("writing the gradient needs scale [C] and grad [C, V]")
    bv = block_v or min(BLOCK_V, triton.next_power_of_2(V))
    dummy = kl  # never dereferenced when WRITE_GRAD is off
    hints = L2_HINTS if l2_hints is None else l2_hints
    _reverse_kl_rows_kernel[(C,)](
        zs, zt, grad if write_grad else dummy, scale if write_grad else dummy, kl, V,
        zs.stride(0), zt.stride(0), grad.stride(0) if write_grad else 0,
        BLOCK_V=bv, WRITE_GRAD=write_grad, REVERSE=REVERSE_SWEEP if reverse is None else reverse,
        KEEP="evict_last" if hints else "", DROP="evict_first" if hints else "",
        num_warps=num_warps or NUM_WARPS)
    return kl


@triton.jit
def _scale_unless_one_kernel(x_ptr, s_ptr, n, BLOCK: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:  # the common case (loss backpropagated unscaled) reads one scalar and exits
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        x = tl.load(x_ptr + offs, mask=live).to(tl.float32)
        tl.store(x_ptr + offs, (x * s).to(x_ptr.dtype.element_ty), mask=live)


def scale_unless_one_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x *= s in place (x contiguous, s a one-element tensor on x's device), skipped on the device when
    s == 1: no host sync to find out, so a backward that scales gradients by grad_output costs one tiny
    launch when grad_output is 1 and never stalls the host."""
    if not x.is_contiguous() or s.numel() != 1:
        raise ValueError("scale_unless_one_ needs a contiguous tensor and a one-element scale")
    n = x.numel()
    if n:
        block = 8192
        _scale_unless_one_kernel[(triton.cdiv(n, block),)](x, s, n, BLOCK=block, num_warps=8)
    return x

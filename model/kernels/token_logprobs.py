"""Triton kernels for one token chunk of the target log-probs and entropy (seed §5.2.2; verl's entropy).

Given a chunk's logit rows z [C, V] (bf16 or fp32, one row per token), the targets y [C] and a sampling
temperature τ, with s = z / τ and p = softmax(s):

    forward, one program per row, one sweep over V in tiles of BLOCK_V:
        lse = log Σ_v exp(s_v)              (online: running max m, S = Σ exp(s - m) rescaled as m grows)
        lp  = s_y - lse                      (the target's log-prob; s_y read once, by address)
        H   = -Σ_v p_v log p_v = log S - B / S,   B = Σ_v exp(s_v - m)(s_v - m)      (ENTROPY only)
    backward, one program per row, one sweep:
        g_z = ( g_lp·(δ_{v,y} - p_v) - g_H·p_v·(log p_v + H) ) / τ     written in place over z.

H = lse - Σ_v p_v s_v is the identity the reverse-KL kernel uses for its A term; here it is kept relative to the
running max (B ≤ 0, log S ≥ 0), so H = log S + |B| / S adds two non-negative numbers and a peaked row (H ≈ 0,
lse ≈ max s) loses nothing to cancellation. When m grows to m', B rescales as
    B' = e^{m - m'} (B + (m - m') S),
the same exponential that rescales S, plus the shift of the terms already summed.

Each backward program reads a tile of its own row before overwriting it, so the in-place write is race-free.
Loads upcast to fp32; the gradient is stored in the buffer's dtype. The matmuls that produce z and consume g_z
stay in torch (cuBLAS); `model/token_logprobs.py` drives them and holds the PyTorch references. Compiled on a GPU,
tl.exp / tl.log are the fast approximate versions (relative error ~1e-6 in fp32); the parity tests say how much
room they leave.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_logprobs_fwd_kernel(z_ptr, y_ptr, lp_ptr, lse_ptr, ent_ptr, V, stride_z, temp,
                               BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s_sum = 0.0
    b = 0.0  # Σ exp(s - m)(s - m), ENTROPY only
    for v0 in range(0, V, BLOCK_V):
        live = v0 + cols < V
        s = tl.load(z_row + v0 + cols, mask=live, other=0.0).to(tl.float32) / temp
        s = tl.where(live, s, -float("inf"))  # dead lanes drop out of the max and the sums
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
        e = tl.exp(s - m_new)  # 0 on dead lanes
        if ENTROPY:
            # the terms already in b shift by (m - m_new); on the first tile there are none (s_sum = 0, and
            # m = -inf is replaced so as not to form 0 · -inf)
            shift = (tl.where(s_sum > 0.0, m, m_new) - m_new) * s_sum
            b = alpha * (b + shift) + tl.sum(e * tl.where(live, s - m_new, 0.0), axis=0)
        s_sum = s_sum * alpha + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s_sum)
    lse = m + log_s
    y = tl.load(y_ptr + row)
    s_y = tl.load(z_row + y).to(tl.float32) / temp
    tl.store(lp_ptr + row, s_y - lse)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:
        tl.store(ent_ptr + row, log_s - b / s_sum)


@triton.jit
def _token_logprobs_bwd_kernel(z_ptr, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, V, stride_z, temp,
                               BLOCK_V: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    y = tl.load(y_ptr + row)
    g_lp = 0.0
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + row).to(tl.float32)
    g_ent = 0.0
    ent = 0.0
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + row).to(tl.float32)
        ent = tl.load(ent_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        live = idx < V
        s = tl.load(z_row + idx, mask=live, other=0.0).to(tl.float32) / temp
        logp = s - lse
        p = tl.exp(logp)
        g = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_GLP:
            g = g_lp * (tl.where(idx == y, 1.0, 0.0) - p)
        if HAS_GENT:
            g = g - g_ent * p * (logp + ent)
        tl.store(z_row + idx, (g / temp).to(z_ptr.dtype.element_ty), mask=live)


BLOCK_V = 4096  # vocab tile, as the reverse-KL kernel's (151936 = 37.1 tiles)
NUM_WARPS = 8


def _check_rows(z: torch.Tensor, targets: torch.Tensor, *rows: torch.Tensor | None) -> tuple[int, int]:
    if z.dim() != 2 or z.stride(-1) != 1:
        raise ValueError(f"expected a [C, V] logit chunk with contiguous rows, got {tuple(z.shape)} strides {z.stride()}")
    C, V = z.shape
    if targets.shape != (C,) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [{C}], got {targets.dtype} {tuple(targets.shape)}")
    for t in rows:
        if t is not None and (t.shape != (C,) or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"per-row values must be contiguous float32 [{C}], got {t.dtype} {tuple(t.shape)}")
    return C, V


def token_logprobs_rows(z: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, entropy: bool = False,
                        logprobs: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                        ent: torch.Tensor | None = None, block_v: int | None = None,
                        num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (log-prob of the target, log-sum-exp, entropy or None) of s = z / temperature, fp32 [C] each.

    z [C, V] logits (rows contiguous), targets [C] int64 in [0, V). `logprobs`, `lse`, `ent`: contiguous fp32 [C]
    tensors to write into (default: new ones); `ent` is written only with entropy=True.
    """
    C, V = _check_rows(z, targets, logprobs, lse, ent)
    new = lambda: torch.empty(C, dtype=torch.float32, device=z.device)  # noqa: E731
    logprobs = new() if logprobs is None else logprobs
    lse = new() if lse is None else lse
    ent = (new() if ent is None else ent) if entropy else None
    if C == 0 or V == 0:
        if V == 0 and C:
            raise ValueError("an empty vocabulary has no log-probabilities")
        return logprobs, lse, ent
    bv = block_v or min(BLOCK_V, triton.next_power_of_2(V))
    _token_logprobs_fwd_kernel[(C,)](z, targets, logprobs, lse, ent if entropy else lse, V, z.stride(0),
                                     float(temperature), BLOCK_V=bv, ENTROPY=entropy, num_warps=num_warps or NUM_WARPS)
    return logprobs, lse, ent


def token_logprobs_grad_rows_(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                              grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                              temperature: float = 1.0, *, block_v: int | None = None,
                              num_warps: int | None = None) -> torch.Tensor:
    """Overwrite z [C, V] with dL/dz, L's gradients in the log-probs and entropies of the rows being
    `grad_logprobs` and `grad_entropy` (fp32 [C] each, None meaning zero; `ent` needed with `grad_entropy`).
    `lse` and `ent` are `token_logprobs_rows`' outputs for the same z. Returns z."""
    C, V = _check_rows(z, targets, lse, ent, grad_logprobs, grad_entropy)
    if grad_entropy is not None and ent is None:
        raise ValueError("the entropy's gradient needs the entropies")
    if C == 0:
        return z
    bv = block_v or min(BLOCK_V, triton.next_power_of_2(V))
    dummy = lse  # never dereferenced behind a False flag
    _token_logprobs_bwd_kernel[(C,)](
        z, targets, lse, ent if grad_entropy is not None else dummy,
        grad_logprobs if grad_logprobs is not None else dummy, grad_entropy if grad_entropy is not None else dummy,
        V, z.stride(0), float(temperature), BLOCK_V=bv, HAS_GLP=grad_logprobs is not None,
        HAS_GENT=grad_entropy is not None, num_warps=num_warps or NUM_WARPS)
    return z

"""Routed experts without a Python loop over experts (issue #15, item 4): grouped GEMMs over the (token,
expert) pairs sorted by expert, with no host sync, so that an MoE decode step can be captured in a CUDA graph.
The reference is `ExpertBank.forward`'s loop (model/decoder.py); on CPU the tests run these kernels with
TRITON_INTERPRET=1.

    align_by_expert(ids, E, BLOCK_M)  the N·k (token, slot) pairs ordered by expert, each expert's run padded
                                      to a multiple of BLOCK_M (pad entries = N·k, skipped), and the expert
                                      of every BLOCK_M block (E for blocks past the last: skipped). All on the
                                      device; the buffer sizes are bounds known on the host (N·k + min(N·k,
                                      E)·(BLOCK_M − 1)), so nothing is read back
    gate_up kernel                    h[p] = silu(x[p // k] · W_gate[e]ᵀ) · (x[p // k] · W_up[e]ᵀ)   (fp32
                                      accumulation, rounded once to the dtype)
    down kernel                       o[p] = (h[p] · W_down[e]ᵀ) · weight[p]
    moe_experts(...)                  y[t] = Σ_j o[t·k + j]

Each program computes one BLOCK_M x BLOCK_N tile of one expert's rows, so a block reads one expert's weight
tile once for up to BLOCK_M of its pairs (in decode most experts get one or two pairs: the weights are read
once, which is the step's cost).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [N, k] -> (pairs [P] int64: pair indices t·k + j grouped by expert, each expert's run padded
    to a multiple of block_m with N·k; block_expert [P / block_m] int64: the expert of each block, num_experts
    past the last run). No host sync: P is a bound computed from the shapes."""
    flat = expert_ids.reshape(-1).long()
    nk, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(nk, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # position within its expert's run
    dest = (pad_end - padded)[expert_of] + rank
    bound = nk + min(nk, num_experts) * (block_m - 1)
    size = triton.cdiv(max(bound, 1), block_m) * block_m
    pairs = torch.full((size,), nk, dtype=torch.long, device=dev).scatter_(0, dest, order)
    block_start = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)  # pad_end[e-1] <= start < pad_end[e]
    return pairs, block_expert


@triton.jit
def _block_pairs(pairs_ptr, pid_m, NK, BLOCK_M: tl.constexpr):
    """The (token, slot) pairs of block pid_m and which of them are real (padding holds NK)."""
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, pair < NK


@triton.jit
def _gate_up_kernel(x_ptr, g_ptr, u_ptr, pairs_ptr, block_expert_ptr, h_ptr, NK, TOP_K, D, F, E,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < E:
        pair, valid = _block_pairs(pairs_ptr, pid_m, NK, BLOCK_M)
        tok = tl.where(valid, pair // TOP_K, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < F
        w_base = e.to(tl.int64) * F * D
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < D
            a = tl.load(x_ptr + tok[:, None] * D + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_off = w_base + cols[None, :] * D + kk[:, None]  # [BLOCK_K, BLOCK_N]: W[e][cols, kk]ᵀ
            w_ok = col_ok[None, :] & k_ok[:, None]
            wg = tl.load(g_ptr + w_off, mask=w_ok, other=0.0)
            wu = tl.load(u_ptr + w_off, mask=w_ok, other=0.0)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g += tl.dot(a, wg, input_precision=PRECISION)
            acc_u += tl.dot(a, wu, input_precision=PRECISION)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + pair[:, None] * F + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, weights_ptr, o_ptr, NK, F, D, E,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < E:
        pair, valid = _block_pairs(pairs_ptr, pid_m, NK, BLOCK_M)
        row = tl.where(valid, pair, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < D
        w_base = e.to(tl.int64) * D * F
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < F
            a = tl.load(h_ptr + row[:, None] * F + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + w_base + cols[None, :] * F + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
        acc = acc * tl.load(weights_ptr + row, mask=valid, other=0.0)[:, None]
        tl.store(o_ptr + pair[:, None] * D + cols[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                up: torch.Tensor, down: torch.Tensor, block_m: int = 16, block_n: int = 64, block_k: int = 64
                ) -> torch.Tensor:
    """x [N, d]; expert_ids, weights [N, k]; gate, up [E, f, d]; down [E, d, f] -> Σ_j weights[:, j] ·
    expert_{ids[:, j]}(x), [N, d] in x's dtype: `ExpertBank.forward` without its loop over experts or a host
    read. Forward only (no autograd): the rollout path."""
    N, k = expert_ids.shape
    E, F, D = gate.shape
    nk = N * k
    if nk == 0:
        return torch.zeros_like(x)
    pairs, block_expert = align_by_expert(expert_ids, E, block_m)
    xc = x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 exact as the reference; bf16 takes tensor cores
    upcast = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's dot has no bf16: products in fp32 there
    h = torch.empty(nk, F, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(F, block_n))
    _gate_up_kernel[grid](xc, gate.contiguous(), up.contiguous(), pairs, block_expert, h, nk, k, D, F, E,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                          UPCAST=upcast)
    o = torch.empty(nk, D, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(D, block_n))
    _down_kernel[grid](h, down.contiguous(), pairs, block_expert, weights.reshape(-1).float().contiguous(), o,
                       nk, F, D, E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                       UPCAST=upcast)
    return o.view(N, k, D).sum(1, dtype=torch.float32).to(x.dtype)

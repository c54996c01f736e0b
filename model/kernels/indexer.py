"""Hierarchical indexer pool scoring (seed §2.3.2): a Reindex layer scores only its candidate pool.

    scores[b, t, p] = Σ_h w[b, t, h] · relu(q[b, t, h] · k[b, pool[b, t, p]])   (-inf where not pool_valid)

The PyTorch reference (`pool_scores_ref`, what `model.sparse_attention.index_scores` computes on the
gathered keys) materialises the gathered indexer K [B, T, P, DI], the dots [B, T, HI, P] in the input
dtype and two float32 copies of them. This kernel reads each pool row of indexer K once, straight from
the [B, N, DI] store, and keeps everything else in registers: grid (B·T, P / BLOCK_P); a program holds
the query's HI x DI indexer Q and scores BLOCK_P pool positions with one tl.dot.

Arithmetic follows the reference: the dots accumulate in float32 and are rounded to the input dtype
(the reference's einsum returns bf16 dots for bf16 inputs), then relu and the float32 weighted sum over
heads. So the kernel matches the reference up to float32 summation order (as two cuBLAS calls of
different shapes do); bf16 dots round to nearest even by integer bit arithmetic, identically compiled
and interpreted (the interpreter's own float32 -> bf16 cast truncates). float32 inputs run IEEE
float32 dots (no TF32), as PyTorch's default matmul; the interpreter (CPU tests) always multiplies in
float32, exactly for bf16 operands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Kernel dtypes -> how the float32 dots are rounded to the input dtype (0: not at all)."""
BLOCK_P = 128
"""Pool positions per program (any power of two >= 16). H200 at the bench's 128K decode shape (python -m
model.kernels.indexer, 64 queries x 4096 positions, bf16): 30.8 us per call at 128 / 4 warps, 33.6 at 64,
39.4 at 32 (8 warps: slower at every size); the reference gather + einsums take 343.9 us."""


def pool_scores_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pool: torch.Tensor,
                    pool_valid: torch.Tensor) -> torch.Tensor:
    """q [B, T, HI, DI], w [B, T, HI], k [B, N, DI], pool [B, T, P] entry ids, pool_valid [B, T, P]
    -> [B, T, P] float32 (float64 for float64 inputs), -inf where not valid. Plain PyTorch."""
    B, N, DI = k.shape
    if N == 0:
        kg = k.new_zeros(*pool.shape, DI)
    else:
        kg = k[torch.arange(B, device=k.device).view(B, 1, 1), pool]
    dots = torch.einsum("bthd,btpd->bthp", q, kg)
    ct = torch.promote_types(dots.dtype, torch.float32)
    scores = torch.einsum("bthp,bth->btp", dots.to(ct).relu(), w.to(ct))
    return scores.masked_fill(~pool_valid, float("-inf"))


def supports(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes (the caller also keeps autograd cases on the reference)."""
    DI = q.shape[-1]
    return (q.dtype in _ROUND and k.dtype == q.dtype and w.dtype in _ROUND and DI >= 16 and DI & (DI - 1) == 0
            and q.device == k.device == w.device)


@triton.jit
def _pool_scores_kernel(q_ptr, w_ptr, k_ptr, ids_ptr, ok_ptr, out_ptr, T, P,
                        sq_b, sq_t, sq_h, sw_b, sw_t, sw_h, sk_b, sk_n,
                        HI: tl.constexpr, H_PAD: tl.constexpr, DI: tl.constexpr, BLOCK: tl.constexpr,
                        ROUND: tl.constexpr, IEEE: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, DI)
    hm = h < HI
    q = tl.load(q_ptr + b * sq_b + t * sq_t + h[:, None] * sq_h + d[None, :], mask=hm[:, None], other=0.0)
    w = tl.load(w_ptr + b * sw_b + t * sw_t + h * sw_h, mask=hm, other=0.0).to(tl.float32)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pm = p < P
    ok = tl.load(ok_ptr + bt * P + p, mask=pm, other=0) != 0
    ids = tl.load(ids_ptr + bt * P + p, mask=pm, other=0).to(tl.int64)
    k = tl.load(k_ptr + b * sk_b + ids[:, None] * sk_n + d[None, :], mask=ok[:, None], other=0.0)
    if IEEE:
        dots = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(k))  # [H_PAD, BLOCK] float32 accumulators
    # the reference's dots are in the input dtype: round to nearest even, by bits for bf16 (the
    # interpreter's float32 -> bf16 cast truncates, so the kernel rounds the same way everywhere)
    if ROUND == 1:
        u = dots.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        dots = u.to(tl.float32, bitcast=True)
    elif ROUND == 2:
        dots = dots.to(tl.float16).to(tl.float32)
    s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    tl.store(out_ptr + bt * P + p, tl.where(ok, s, float("-inf")), mask=pm)


def pool_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pool: torch.Tensor, pool_valid: torch.Tensor,
                *, block_p: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Triton version of `pool_scores_ref` (same arguments) -> [B, T, P] float32. No autograd."""
    B, T, HI, DI = q.shape
    P = pool.shape[-1]
    if not supports(q, w, k):
        raise ValueError(f"pool_scores takes float32/bf16/fp16 q and k of one dtype and a power-of-two index "
                         f"dim >= 16; got q {q.dtype}, k {k.dtype}, w {w.dtype}, dim {DI}")
    out = torch.empty(B, T, P, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    pool, ok = pool.contiguous(), pool_valid.contiguous().view(torch.uint8)
    block = block_p or BLOCK_P
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (B * T, triton.cdiv(P, block))
    _pool_scores_kernel[grid](
        q, w, k, pool, ok, out, T, P,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), w.stride(2), k.stride(0), k.stride(1),
        HI=HI, H_PAD=max(16, triton.next_power_of_2(HI)), DI=DI, BLOCK=block, ROUND=_ROUND[q.dtype],
        IEEE=q.dtype == torch.float32 or interpreted, num_warps=num_warps,
    )
    return out


def _sweep() -> None:  # python -m model.kernels.indexer: pool scoring alone at the bench's 128K decode shape
    import triton.testing

    B, HI, DI, N, P = 64, 64, 128, 32768, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, HI, DI, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, 1, HI, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, N, DI, device="cuda", generator=g).bfloat16()
    blocks = torch.rand(B, 1, N // 8, device="cuda", generator=g).argsort(-1)[..., : P // 8].sort(-1).values
    pool = (blocks[..., None] * 8 + torch.arange(8, device="cuda")).flatten(-2)
    ok = torch.ones_like(pool, dtype=torch.bool)
    ref = pool_scores_ref(q, w, k, pool, ok)
    us = triton.testing.do_bench_cudagraph(lambda: pool_scores_ref(q, w, k, pool, ok)) * 1e3
    print(f"reference (gather + einsums): {us:8.1f} us per call of {B} queries")
    for block in (32, 64, 128):
        for warps in (4, 8):
            out = pool_scores(q, w, k, pool, ok, block_p=block, num_warps=warps)
            err = (out - ref).abs().max().item()
            us = triton.testing.do_bench_cudagraph(lambda: pool_scores(q, w, k, pool, ok, block_p=block, num_warps=warps)) * 1e3
            print(f"kernel block_p={block:3d} num_warps={warps}: {us:8.1f} us per call (max |diff| {err:.3g})")


if __name__ == "__main__":
    _sweep()

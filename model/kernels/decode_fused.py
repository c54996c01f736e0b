"""Fused kernels of the rollout path (model/fused.py, issue #15): each replaces several eager kernels of a
decode step, which is bound by its kernel count. Every kernel computes in float32 what the plain forward
computes and rounds to the model dtype where the plain forward rounds (so bf16 results agree to the order of
a reduction); their references are the eager forms in model/fused.py, and on CPU the tests run the kernels
with TRITON_INTERPRET=1.

    add_rms_norm(x, r, w)   h = (r + x).to(dtype);  out = (h32 · rsqrt(mean(h32²) + eps) · w32).to(dtype)
                            one kernel for the residual add and the next RMSNorm (were 2: add, norm)
    silu_mul(gate_up)       s = silu(g32).to(dtype);  out = (s32 · u32).to(dtype)
                            one kernel for SwiGLU's elementwise part over the fused gate_up GEMM (were 2)
    qkv_norm_rope(qkv, ..)  per head of the fused qkv GEMM's output: q and k RMSNormed (qk-norm, Qwen3; the
                            norm's output rounded to the dtype as RMSNorm returns it), then RoPE
                            (x32·cos + rotate_half(x)32·sin).to(dtype); with a bf16-format cache K and V
                            are written into their slots in the same kernel (padding rows, slot −1, into
                            the scratch slot, as PagedKVCache.write), and at decode an fp4-format cache's
                            rows are encoded there too (model/kernels/fp4.encode_pairs). One kernel where
                            the plain forward has up to 9 (q-norm, k-norm, two RoPEs, the slot fix-up, two
                            index_copy) and fp4 decode had two (this and the quantise)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import fp4 as fp4_kernels


def _warps(block: int) -> int:
    """Warps for a program over `block` elements: ~4 elements per thread up to 8 warps."""
    return max(1, min(8, block // 128))


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    h = (r + x).to(h_ptr.dtype.element_ty)  # the plain forward's `h + y`, rounded to the dtype
    tl.store(h_ptr + row * D + cols, h, mask=m)
    h = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, ((h * inv) * w).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] (same shape and dtype) -> (RMSNorm(residual + x) · w, residual + x), one program
    per row."""
    D = x.shape[-1]
    xc, rc = x.contiguous(), residual.contiguous()
    out, h = torch.empty_like(xc), torch.empty_like(xc)
    rows = xc.numel() // D
    if rows:
        block = triton.next_power_of_2(D)
        _add_rms_norm_kernel[(rows,)](xc, rc, w.contiguous(), out, h, D, eps, BLOCK_D=block, num_warps=_warps(block))
    return out, h


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    g = tl.load(gu_ptr + row * 2 * F + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * F + F + cols, mask=m, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)  # F.silu's output, in the dtype as the plain forward has it
    tl.store(out_ptr + row * F + cols, (s * u).to(ty), mask=m)


SILU_BLOCK = 1024
"""Columns per program of silu_mul: a decode row of a 3072-wide FFN spreads over 3 programs (one program per
row would leave the GPU idle at batch 1)."""


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] (gate, then up) -> silu(gate) · up [..., F]."""
    F2 = gate_up.shape[-1]
    if F2 % 2:
        raise ValueError(f"gate_up width {F2} is odd")
    F = F2 // 2
    gu = gate_up.contiguous()
    out = torch.empty(*gu.shape[:-1], F, dtype=gu.dtype, device=gu.device)
    rows = gu.numel() // F2
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(F))
        _silu_mul_kernel[(rows, triton.cdiv(F, block))](gu, out, F, BLOCK=block, num_warps=_warps(block))
    return out


@triton.jit
def _qkv_norm_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, kc_ptr, vc_ptr, slot_ptr,
                          row_stride, H, KVH, scratch, eps,
                          HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, WRITE: tl.constexpr,
                          ks_ptr=None, vs_ptr=None):
    # WRITE 0: no cache write; 1: the bf16 cache (rows of D values); 2: the fp4 cache (kc/vc: packed rows of
    # D / 2 bytes, ks/vs: scale rows of D / 16 bytes), each 16-value block encoded here as model.fp4.quantize does
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads [0, H), k heads [H, H + KVH), v heads [H + KVH, H + 2·KVH) (WRITE only)
    d = tl.arange(0, BLOCK)
    m = d < HALF
    hv = head + tl.zeros([BLOCK], dtype=tl.int32)  # the head as a block: masks stay blocks of booleans
    is_q = m & (hv < H)
    is_k = m & (hv >= H) & (hv < H + KVH)
    is_v = m & (hv >= H + KVH)
    not_q = m & (hv >= H)
    src = qkv_ptr + tok * row_stride + head * (2 * HALF)
    x1 = tl.load(src + d, mask=m, other=0.0)
    x2 = tl.load(src + HALF + d, mask=m, other=0.0)
    ty = q_ptr.dtype.element_ty
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:  # qk-norm: the head's RMSNorm with the q or the k weight (a v head's result is never stored)
        w1 = (tl.load(qw_ptr + d, mask=is_q, other=0.0).to(tl.float32)
              + tl.load(kw_ptr + d, mask=not_q, other=0.0).to(tl.float32))
        w2 = (tl.load(qw_ptr + HALF + d, mask=is_q, other=0.0).to(tl.float32)
              + tl.load(kw_ptr + HALF + d, mask=not_q, other=0.0).to(tl.float32))
        inv = 1.0 / tl.sqrt((tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) / (2 * HALF) + eps)
        a1 = ((a1 * inv) * w1).to(ty).to(tl.float32)  # RMSNorm returns the dtype; RoPE reads that
        a2 = ((a2 * inv) * w2).to(ty).to(tl.float32)
    cb = tok * (2 * HALF)
    c1 = tl.load(cos_ptr + cb + d, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + cb + HALF + d, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + cb + d, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + cb + HALF + d, mask=m, other=0.0)
    o1 = (a1 * c1 + (-a2) * s1).to(ty)  # x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁]
    o2 = (a2 * c2 + a1 * s2).to(ty)
    qh = tl.minimum(head, H - 1)  # in-range row offsets for the masked-off heads too
    kh = tl.minimum(tl.maximum(head - H, 0), KVH - 1)
    qo = q_ptr + (tok * H + qh) * (2 * HALF)
    tl.store(qo + d, o1, mask=is_q)
    tl.store(qo + HALF + d, o2, mask=is_q)
    ko = k_ptr + (tok * KVH + kh) * (2 * HALF)
    tl.store(ko + d, o1, mask=is_k)
    tl.store(ko + HALF + d, o2, mask=is_k)
    if WRITE == 2:  # fp4: K heads encode the RoPE'd row (model dtype), V heads the row as the GEMM gave it (BLOCK == HALF)
        slot = tl.load(slot_ptr + tok)
        slot = tl.where(slot < 0, scratch, slot).to(tl.int64)
        vh = tl.maximum(head - H - KVH, 0)
        NB: tl.constexpr = HALF // 16  # scale blocks per half row
        j = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :]  # byte j of a half row's packed bytes
        hj = head + tl.zeros([NB, 8], dtype=tl.int32)
        hb = head + tl.zeros([NB], dtype=tl.int32)
        sb = tl.arange(0, NB)
        k_row = (slot * KVH + kh) * HALF  # packed bytes: D / 2 = HALF a row; scales: D / 16 = NB · 2
        v_row = (slot * KVH + vh) * HALF
        for part in tl.static_range(2):
            y = tl.where(is_k, (o1 if part == 0 else o2).to(tl.float32), (x1 if part == 0 else x2).to(tl.float32))
            lo, hi = tl.split(tl.reshape(y, (NB, 8, 2)))
            packed, bits = fp4_kernels.encode_pairs(lo, hi)
            tl.store(kc_ptr + k_row + part * (HALF // 2) + j, packed, mask=(hj >= H) & (hj < H + KVH))
            tl.store(vc_ptr + v_row + part * (HALF // 2) + j, packed, mask=hj >= H + KVH)
            tl.store(ks_ptr + (k_row // 8) + part * NB + sb, bits, mask=(hb >= H) & (hb < H + KVH))
            tl.store(vs_ptr + (v_row // 8) + part * NB + sb, bits, mask=hb >= H + KVH)
    elif WRITE:  # the bf16 cache: rows [slots + 1, KVH, D]; padding (slot −1) -> the scratch slot
        slot = tl.load(slot_ptr + tok)
        slot = tl.where(slot < 0, scratch, slot).to(tl.int64)
        vh = tl.maximum(head - H - KVH, 0)
        kc = kc_ptr + (slot * KVH + kh) * (2 * HALF)
        tl.store(kc + d, o1.to(kc_ptr.dtype.element_ty), mask=is_k)
        tl.store(kc + HALF + d, o2.to(kc_ptr.dtype.element_ty), mask=is_k)
        vc = vc_ptr + (slot * KVH + vh) * (2 * HALF)
        tl.store(vc + d, x1.to(vc_ptr.dtype.element_ty), mask=is_v)
        tl.store(vc + HALF + d, x2.to(vc_ptr.dtype.element_ty), mask=is_v)


def qkv_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, eps: float,
                  cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2·KVH)·D] (the fused qkv GEMM's output); cos, sin [B, T, 1, D] float32
    (model.decoder.rope_cos_sin); q_norm_w, k_norm_w [D] or None (no qk-norm).
    cache: (k_pool, v_pool [slots + 1, KVH, D] of one layer, slot_mapping [B, T] (−1: padding), scratch slot)
    to write K and V into a bf16-format PagedKVCache in the same kernel; with (packed, scales) pairs for the pools
    ([slots + 1, KVH, D / 2] and [slots + 1, KVH, D / 16], uint8 or float8 scales), into an fp4-format one,
    bit for bit what `PagedKVCache.write` stores (`fp4_write_ok` says which shapes); None: no write.
    -> q [B, T, H, D] and k [B, T, KVH, D] (new, contiguous), v [B, T, KVH, D] (a view of qkv)."""
    B, T, W = qkv.shape
    D, H, KVH = cos.shape[-1], num_heads, num_kv_heads
    if W != (H + 2 * KVH) * D:
        raise ValueError(f"qkv width {W} is not (H + 2·KVH)·D = {(H + 2 * KVH) * D}")
    qkv = qkv.contiguous()
    N = B * T
    c = cos.expand(B, T, 1, D).reshape(N, D).float().contiguous()
    s = sin.expand(B, T, 1, D).reshape(N, D).float().contiguous()
    q = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(B, T, KVH, D, dtype=qkv.dtype, device=qkv.device)
    v = qkv[..., (H + KVH) * D:].view(B, T, KVH, D)
    if N == 0:
        return q, k, v
    has_norm = q_norm_w is not None
    qw, kw = (q_norm_w.contiguous(), k_norm_w.contiguous()) if has_norm else (q, q)  # unused without the norm
    write, ks = 0, None
    if cache is not None:
        kc, vc, slots, scratch = cache
        write = 1
        if isinstance(kc, tuple):  # fp4: (packed, scales) per pool
            if not fp4_write_ok(D):
                raise ValueError(f"the fused fp4 write takes head_dim a power of two >= 32, not {D}")
            (kc, ks), (vc, vs) = kc, vc
            ks, vs = ks.view(torch.uint8), vs.view(torch.uint8)
            write = 2
            shapes = [(kc, D // 2), (vc, D // 2), (ks, D // 16), (vs, D // 16)]
        else:
            shapes = [(kc, D), (vc, D)]
        if not all(t.is_contiguous() and t.shape[1:] == (KVH, w) and t.shape[0] == kc.shape[0] for t, w in shapes):
            raise ValueError("cache pools must be contiguous [slots + 1, KVH, row width]")
        slots = slots.reshape(N).contiguous()
    else:
        kc = vc = k
        slots, scratch = torch.empty(1, dtype=torch.long, device=qkv.device), 0  # unused without the write
    block = triton.next_power_of_2(D // 2)
    heads = H + KVH + (KVH if cache is not None else 0)
    extra = {"ks_ptr": ks, "vs_ptr": vs} if write == 2 else {}
    _qkv_norm_rope_kernel[(N, heads)](qkv, c, s, qw, kw, q, k, kc, vc, slots, W, H, KVH, scratch, eps,
                                      HALF=D // 2, BLOCK=block, HAS_NORM=has_norm, WRITE=write,
                                      num_warps=max(1, min(4, block // 32)), **extra)
    return q, k, v


def fp4_write_ok(head_dim: int) -> bool:
    """Whether `qkv_norm_rope` can write an fp4 cache for this head_dim: each RoPE half a whole number of
    16-value scale blocks held by one program (a power of two >= 32)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0

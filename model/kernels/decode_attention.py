"""Paged decode attention (one query token per sequence) over a dense, FP8 or FP4 KV cache.

Seed §2.4.4: the main KV cache is stored in FP4 and dequantised before attention ("FP4 reduces
storage rather than accelerates matrix multiplication"); the SWA KV stays FP8. This kernel reads the
stored format and dequantises each tile in registers, so HBM traffic is the compressed bytes.

Cache layout (one layer; `PagedKVCache` keeps [L, slots + 1, KVH, ...] and passes `pool[layer]`):
    dense: k, v            [num_slots, KVH, D]        any float dtype
    fp8:   (values, scale) [num_slots, KVH, D] float8_e4m3fn (or uint8), [num_slots, KVH] uint8 E8M0
    fp4:   (packed, scale) [num_slots, KVH, D // 2] uint8, [num_slots, KVH, D // 16] float8_e4m3fn (or
                           uint8): the model.fp4 / model.fp8 formats, last dims contiguous
Sequence b's token j lives in slot `block_table[b, j // block_size] * block_size + j % block_size`
(a slot list is the block_size = 1 case); tokens j >= context_lens[b] are never read, so the table's
tail may hold anything; a sequence of length 0 gets a zero output.

Algorithm (flash-decoding): grid (B, KVH, splits); a program takes the G = H / KVH query heads of one
KV head (GQA: the KV tile is read once for the whole group) over one contiguous chunk of the context,
runs an online softmax over BLOCK_N-token tiles and writes a normalised partial output and its
log2-sum-exp; a second kernel merges the splits. Splits default to enough programs to fill the GPU.

Arithmetic: scores and the output accumulate in float32. The products run on tensor cores in
    fp32 q:  float32 ("ieee"), every format: the PyTorch reference's arithmetic up to summation order;
    bf16/fp16 q: dense -> the cache dtype; fp8 -> bf16 (E4M3 is exact in bf16; the per-row scale
             multiplies the scores and the probabilities instead of every element); fp4 -> fp16: a
             4-bit code c becomes the fp16 whose bits are (c & 7) << 9 | (c & 8) << 12, which is
             E2M1(c) · 2^-14 exactly (E2M1's exponent and mantissa bits land in fp16's, its subnormal
             0.5 in fp16's subnormal range), times the E4M3 scale in fp16 is still exact (all products
             are multiples of 2^-24 below 2688 · 2^-14), and 2^14 comes back in float32 after the
             dots (on CUDA the bit placement and the scale multiply are inline PTX, `_E2M1X8_F16_ASM`:
             ~2.4 instructions per value). The dequantised K and V are therefore exact; q (|q| < 65504) and the softmax
             probabilities are rounded to fp16 / bf16 as in any half-precision attention kernel.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Literal

import torch
import triton
import triton.language as tl

from model import fp4 as fp4_ref
from model import fp8 as fp8_ref
from model.kernels.fp4 import E2M1X8_F16_PTX, e2m1_f16_bits

KVFormat = Literal["dense", "fp8", "fp4"]
KVTensors = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
_FMT = {"dense": 0, "fp8": 1, "fp4": 2}
LOG2E = 1.4426950408889634
# fp4 tile load and decode (see _load_fp4_halves): 0 / 1 Triton ops on a 2-D / 3-D tile, 2 / 3 the same
# tiles decoded by inline PTX (CUDA only; the interpreter and other devices run 0 / 1 instead); the
# bench's --sweep times them all
FP4_DECODE = 2
FP4_SC_WORDS = True  # decode 2 / 3: fp4 scales loaded as int32 words where aligned (_load_scale_bytes)
# default fp4 split count: the decode-2 kernel at block_n 128, 4 warps takes 128 registers and ~60 KB of
# shared memory, so 3 programs fit an H200 SM; a grid of one full wave of them (B=8, KVH=8: 6 splits) was
# the fastest in the H200 sweep (bench/fp4_kv.py --sweep): 2-3 programs per SM in two waves lose ~15%
FP4_PROGRAMS_PER_SM = 3
# default tokens per tile (H200 sweep at 32K context, bench/fp4_kv.py --sweep): dense 64, fp4 128
BLOCK_N = {"dense": 64, "fp8": 64, "fp4": 128}
# fp4 launch where the block table holds at most this many tokens (a rollout's decode: bench/engine.py's 400):
# smaller tiles in two pipeline stages (fewer registers and less shared memory, more programs per SM), and with
# one to four waves of (sequence, KV head) programs two splits (at any context). H200, Qwen3-0.6B attention shape,
# device time in CUDA-graph replay (bench/paged_attention.py): batch 64 30.5 -> 27.3 us, batch 1 7.2 -> 5.5 us,
# batch 256 93.6 -> 92.8 us; longer contexts keep the tiles above (2K: 128-token tiles; 16K: level with bf16).
FP4_SHORT_CONTEXT = 512
# fp4 kernel: "gluon" (the default where `_gluon_fp4_refusal` lets it: CUDA, bf16/fp16 q, head_dim 64/128;
# model/kernels/decode_attention_gluon.py: the decoded K tile built in the tensor-core operand layout, no shared-memory
# round trip) or "triton" (_decode_partial_kernel: every other call, and ASYNCRL_FP4_KERNEL=triton). H200 engine,
# Qwen3-0.6B shape, FP4 ms/step Triton -> Gluon side by side in one run (BENCHMARKS.md, "FP4 decode attention faster
# than bf16 in the engine"): see GLUON_MAXNREG's figures; graph-replay device time of one call at b16 16K 248.5 -> 240.5 us
FP4_KERNEL = os.environ.get("ASYNCRL_FP4_KERNEL", "gluon")
GLUON_PREFETCH = False  # the next tile's loads one iteration ahead: slower on the H200 (repacking the carried bytes)
# Gluon launch at contexts past FP4_SHORT_CONTEXT: about this many programs per SM in splits (b64 at 2K: 4 splits,
# b16 at 16K: 16; the same sweep)
GLUON_PROGRAMS_PER_SM = 16
# registers per thread the Gluon launch caps (None: ptxas's choice). Uncapped, ptxas gives the 64-token tile 130
# registers: 3 programs (12 warps) per SM. At 128 it spills nothing (bench/kernel_isa.py --gluon) and 4 fit, which hides
# a third more of HBM's latency: H200 engine, Qwen3-0.6B shape, FP4 ms/step uncapped -> capped 8.36 -> 7.58 at b16
# 16K, 5.14 -> 4.77 at b64 2K, 1.98 -> 1.85 at b64, 3.96 -> 3.66 at b256 (bf16: 8.16, 4.92, 1.92, 3.84;
# BENCHMARKS.md, "FP4 decode attention faster than bf16 in the engine")
GLUON_MAXNREG = 128


# -- PyTorch reference -----------------------------------------------------------------------------
def _dequantize_rows(cache: KVTensors, slots: torch.Tensor, kv_format: KVFormat) -> torch.Tensor:
    """cache rows at `slots` -> float32 [n, KVH, D]."""
    if kv_format == "dense":
        return cache[slots].float()
    data, scale = cache
    if kv_format == "fp8":
        return fp8_ref.dequantize(data[slots].view(torch.float8_e4m3fn), scale[slots])
    return fp4_ref.dequantize(data[slots], scale[slots].view(torch.float8_e4m3fn))


def decode_attention_ref(
    q: torch.Tensor, k: KVTensors, v: KVTensors, block_table: torch.Tensor, context_lens: torch.Tensor,
    block_size: int, *, kv_format: KVFormat = "dense", sm_scale: float | None = None,
) -> torch.Tensor:
    """Dequantise the context with model.fp4 / model.fp8, then softmax(q·Kᵀ·scale)·V in float32.
    q [B, H, D] -> [B, H, D] (q.dtype). Loops over sequences on the host: for tests, not speed."""
    B, H, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        if n == 0:
            continue
        j = torch.arange(n, device=q.device)
        slots = block_table[b, j // block_size].long() * block_size + j % block_size
        kk, vv = _dequantize_rows(k, slots, kv_format), _dequantize_rows(v, slots, kv_format)  # [n, KVH, D]
        G = H // kk.shape[1]
        kk, vv = kk.repeat_interleave(G, dim=1), vv.repeat_interleave(G, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kk) * sm_scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, vv)
    return out.to(q.dtype)


# -- Triton kernels --------------------------------------------------------------------------------
@triton.jit
def _mm_nt(a, b, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """a [M, K] · b [N, K]ᵀ -> float32 [M, N]. Without USE_DOT (a dim below tl.dot's 16): broadcast-sum.
    IEEE also serves the interpreter, whose tl.dot multiplies bf16 operands' raw bits (Triton 3.9):
    the operands go up to float32 there, exactly."""
    if USE_DOT:
        if IEEE:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            return tl.dot(a, tl.trans(b), input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(b))
    else:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _mm_nn(a, b, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """a [M, N] · b [N, K] -> float32 [M, K]."""
    if USE_DOT:
        if IEEE:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


_E2M1X8_F16_ASM = tl.constexpr(E2M1X8_F16_PTX)  # model/kernels/fp4.py says what it computes


@triton.jit
def _e2m1_scaled_f16(p, sc, ASM: tl.constexpr):
    """Packed bytes p (uint8) and fp16 scales sc (same shape) -> (low nibbles, high nibbles) as fp16
    E2M1 · 2^-14 · scale. ASM: the PTX above (GPU only: inline asm has no interpreter fallback)."""
    if ASM:
        return tl.inline_asm_elementwise(_E2M1X8_F16_ASM, "=r,=r,=r,=r,r,r,r", [p, sc],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        p = p.to(tl.int32)
        return e2m1_f16_bits(p) * sc, e2m1_f16_bits(p >> 4) * sc


@triton.jit
def _load_scale_bytes(sc_ptr, sc_row, valid, NB: tl.constexpr, BLOCK_N: tl.constexpr, SC_WORDS: tl.constexpr):
    """[BLOCK_N, NB] scale bytes of the rows at byte offsets sc_row. SC_WORDS (rows 4-byte aligned, NB a
    multiple of 4): load them as int32 words and split the bytes in registers, so that the load is wide
    enough for the compiler to make it asynchronous (pipelined like the values) instead of NB byte loads."""
    if SC_WORDS:
        NW: tl.constexpr = NB // 4
        w = tl.load(sc_ptr.to(tl.pointer_type(tl.int32)) + (sc_row // 4)[:, None] + tl.arange(0, NW)[None, :],
                    mask=valid[:, None], other=0)
        b = (w[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
        return tl.reshape(b, (BLOCK_N, NB)).to(tl.uint8)
    else:
        return tl.load(sc_ptr + sc_row[:, None] + tl.arange(0, NB)[None, :], mask=valid[:, None], other=0)


@triton.jit
def _load_fp4_halves(ptr, sc_ptr, row, sc_row, valid, DH: tl.constexpr, BLOCK_N: tl.constexpr, CD: tl.constexpr,
                     DECODE: tl.constexpr, SC_WORDS: tl.constexpr):
    """FP4 rows -> (even channels, odd channels), each [BLOCK_N, D / 2] in CD, times 2^-14 (exact).

    Byte i of a row holds channels 2i (low nibble) and 2i + 1 (high nibble), both in scale block i // 8.
    DECODE 0: load [BLOCK_N, D / 2] bytes and gather each byte's scale (repeated addresses, served by
    L1); 1: load [BLOCK_N, D / 16, 8] bytes against [BLOCK_N, D / 16] scales (a broadcast) and flatten;
    2 / 3: as 0 / 1 but the scales are loaded once per block ([BLOCK_N, D / 16], contiguous) and
    broadcast, and the nibbles are decoded by inline PTX (`_E2M1X8_F16_ASM`, CUDA only)."""
    NB: tl.constexpr = DH // 8
    if DECODE == 0:
        i = tl.arange(0, DH)
        p = tl.load(ptr + row[:, None] + i[None, :], mask=valid[:, None], other=0)
        sb = tl.load(sc_ptr + sc_row[:, None] + (i // 8)[None, :], mask=valid[:, None], other=0)
        sc = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        lo, hi = _e2m1_scaled_f16(p, sc, False)
    elif DECODE == 2:
        i = tl.arange(0, DH)
        p = tl.load(ptr + row[:, None] + i[None, :], mask=valid[:, None], other=0)
        sb = _load_scale_bytes(sc_ptr, sc_row, valid, NB, BLOCK_N, SC_WORDS)
        sc = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, NB, 8)), (BLOCK_N, DH))
        lo, hi = _e2m1_scaled_f16(p, sc, True)
    else:
        jb = tl.arange(0, NB)
        e = tl.arange(0, 8)
        p = tl.load(ptr + row[:, None, None] + (jb[None, :, None] * 8 + e[None, None, :]), mask=valid[:, None, None], other=0)
        sb = _load_scale_bytes(sc_ptr, sc_row, valid, NB, BLOCK_N, SC_WORDS and DECODE == 3)
        sc = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None]
        lo, hi = _e2m1_scaled_f16(p, tl.broadcast_to(sc, (BLOCK_N, NB, 8)), DECODE == 3)
        lo = tl.reshape(lo, (BLOCK_N, DH))
        hi = tl.reshape(hi, (BLOCK_N, DH))
    return lo.to(CD), hi.to(CD)


@triton.jit
def _e8m0_value(bits):
    """E8M0 scale byte -> float32 2^(bits - 127) (bits in 1..254 are float32 exponent fields); 0xFF NaN."""
    v = (bits << 23).to(tl.float32, bitcast=True)
    return tl.where(bits == 0xFF, float("nan"), v)


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr,
    qk_scale, out_scale,
    s_qb, s_qh, s_kt, s_kh, s_kst, s_ksh, s_vt, s_vh, s_vst, s_vsh, s_bt,
    chunk, n_splits,
    H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, FMT: tl.constexpr, CD: tl.constexpr, IEEE: tl.constexpr, USE_DOT: tl.constexpr,
    FP4_DECODE: tl.constexpr, SC_WORDS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    g = tl.arange(0, G_PAD)
    gm = g < G
    head = kvh * G + g
    q_row = q_ptr + b.to(tl.int64) * s_qb + head * s_qh
    DH: tl.constexpr = D // 2
    if FMT == 2:
        i = tl.arange(0, DH)
        q_lo = tl.load(q_row[:, None] + 2 * i[None, :], mask=gm[:, None], other=0.0).to(CD)
        q_hi = tl.load(q_row[:, None] + 2 * i[None, :] + 1, mask=gm[:, None], other=0.0).to(CD)
        acc_lo = tl.zeros([G_PAD, DH], dtype=tl.float32)
        acc_hi = tl.zeros([G_PAD, DH], dtype=tl.float32)
    else:
        d = tl.arange(0, D)
        q = tl.load(q_row[:, None] + d[None, :], mask=gm[:, None], other=0.0).to(CD)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        page = tl.load(bt_ptr + b.to(tl.int64) * s_bt + n // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        k_row = slot * s_kt + kvh * s_kh
        v_row = slot * s_vt + kvh * s_vh
        if FMT == 0:
            kt = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(CD)
            s = _mm_nt(q, kt, USE_DOT, IEEE)
        elif FMT == 1:
            kt = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=valid[:, None], other=0)
            kt = kt.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(CD)
            ksc = _e8m0_value(tl.load(ks_ptr + slot * s_kst + kvh * s_ksh, mask=valid, other=127).to(tl.int32))
            s = _mm_nt(q, kt, USE_DOT, IEEE) * ksc[None, :]
        else:
            k_lo, k_hi = _load_fp4_halves(k_ptr, ks_ptr, k_row, slot * s_kst + kvh * s_ksh, valid, DH, BLOCK_N, CD, FP4_DECODE, SC_WORDS)
            s = _mm_nt(q_lo, k_lo, USE_DOT, IEEE) + _mm_nt(q_hi, k_hi, USE_DOT, IEEE)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if FMT == 0:
            vt = tl.load(v_ptr + v_row[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(CD)
            acc = acc * alpha[:, None] + _mm_nn(p.to(CD), vt, USE_DOT, IEEE)
        elif FMT == 1:
            vt = tl.load(v_ptr + v_row[:, None] + d[None, :], mask=valid[:, None], other=0)
            vt = vt.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(CD)
            vsc = _e8m0_value(tl.load(vs_ptr + slot * s_vst + kvh * s_vsh, mask=valid, other=127).to(tl.int32))
            acc = acc * alpha[:, None] + _mm_nn((p * vsc[None, :]).to(CD), vt, USE_DOT, IEEE)
        else:
            v_lo, v_hi = _load_fp4_halves(v_ptr, vs_ptr, v_row, slot * s_vst + kvh * s_vsh, valid, DH, BLOCK_N, CD, FP4_DECODE, SC_WORDS)
            pc = p.to(CD)
            acc_lo = acc_lo * alpha[:, None] + _mm_nn(pc, v_lo, USE_DOT, IEEE)
            acc_hi = acc_hi * alpha[:, None] + _mm_nn(pc, v_hi, USE_DOT, IEEE)
    inv_l = out_scale / tl.where(l_i > 0, l_i, 1.0)  # an empty split writes 0 and lse -inf
    row = (b * H + head).to(tl.int64) * n_splits + split
    tl.store(lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf")), mask=gm)
    if FMT == 2:
        tl.store(o_ptr + row[:, None] * D + 2 * i[None, :], acc_lo * inv_l[:, None], mask=gm[:, None])
        tl.store(o_ptr + row[:, None] * D + 2 * i[None, :] + 1, acc_hi * inv_l[:, None], mask=gm[:, None])
    else:
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc * inv_l[:, None], mask=gm[:, None])


@triton.jit
def _merge_splits_kernel(o_ptr, lse_ptr, out_ptr, n_splits, D: tl.constexpr, S_PAD: tl.constexpr):
    """out[b, h] = Σ_s w_s · o_s with w_s = 2^(lse_s - max) / Σ 2^(lse - max); all-empty -> 0."""
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    sp = tl.arange(0, S_PAD)
    live = sp < n_splits
    lse = tl.load(lse_ptr + row * n_splits + sp, mask=live, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    d = tl.arange(0, D)
    o = tl.load(o_ptr + (row * n_splits + sp)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    tot = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: few programs, short tests


def _split_pair(x: KVTensors, kv_format: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kv_format == "dense":
        if not isinstance(x, torch.Tensor):
            raise TypeError("kv_format='dense' takes one tensor per K and V")
        return x, None
    if isinstance(x, torch.Tensor) or len(x) != 2:
        raise TypeError(f"kv_format={kv_format!r} takes a (values, scales) pair per K and V")
    data, scale = x
    return data.view(torch.uint8), scale.view(torch.uint8)


@functools.cache
def _gluon_missing() -> str | None:
    """Why this Triton has no Gluon kernel to offer (None: it has)."""
    try:
        import model.kernels.decode_attention_gluon  # noqa: F401  (triton.experimental.gluon: Triton >= 3.5)
    except Exception as e:  # noqa: BLE001  (an ImportError, or an API this Triton spells differently)
        return f"Gluon is not available in Triton {triton.__version__} ({type(e).__name__}: {e})"
    return None


def _gluon_fp4_refusal(q: torch.Tensor, G: int, block_n: int | None) -> str | None:
    """Why the Gluon FP4 kernel cannot take this call (None: it can)."""
    if q.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "it runs compiled on CUDA only"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype} (float32 q keeps the Triton kernel's float32 products)"
    if q.shape[-1] not in (64, 128):
        return f"head_dim {q.shape[-1]} is not 64 or 128"
    if G > 16:
        return f"{G} query heads per KV head (at most 16)"
    if block_n not in (None, 32, 64):
        return f"block_n {block_n} (32 or 64)"
    return _gluon_missing()


def decode_attention(
    q: torch.Tensor, k: KVTensors, v: KVTensors, block_table: torch.Tensor, context_lens: torch.Tensor,
    block_size: int, *, kv_format: KVFormat = "dense", sm_scale: float | None = None,
    max_context_len: int | None = None, num_splits: int | None = None, block_n: int | None = None, num_warps: int = 4,
    num_stages: int | None = None, fp4_decode: int | None = None, fp4_kernel: str | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence) -> attention output [B, H, D] in q.dtype.

    k, v: one layer of the paged pool in `kv_format` (module docstring). block_table [B, max_blocks]
    (int32/int64) and context_lens [B] live on q's device. max_context_len (a host int, default
    max_blocks · block_size: no device sync) bounds the lengths and sizes the split-K grid.
    """
    B, H, D = q.shape
    fmt = _FMT[kv_format]
    kd, ks = _split_pair(k, kv_format)
    vd, vs = _split_pair(v, kv_format)
    KVH = kd.shape[1]
    if H % KVH:
        raise ValueError(f"{H} query heads do not group evenly on {KVH} KV heads")
    width = {0: D, 1: D, 2: D // 2}[fmt]
    if kd.shape[-1] != width or vd.shape[-1] != width or kd.stride(-1) != 1 or vd.stride(-1) != 1:
        raise ValueError(f"{kv_format} cache rows must be contiguous with last dim {width} for head_dim {D}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two >= 16")
    if fmt == 2 and (ks.shape[-1] != D // 16 or ks.stride(-1) != 1):
        raise ValueError("fp4 scales must be [..., D // 16], contiguous")
    G = H // KVH
    G_PAD = max(16, triton.next_power_of_2(G))
    q = q.contiguous()
    ieee = q.dtype == torch.float32
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    cd = {0: kd.dtype, 1: torch.bfloat16, 2: torch.float16}[fmt] if not ieee else torch.float32
    if cd not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dense cache dtype {kd.dtype} is not a float type")
    cd_tl = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[cd]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    fp4_gain = 2.0**14 if fmt == 2 else 1.0  # the E2M1 bit placement's 2^-14, on K and on V
    max_len = block_table.shape[1] * block_size if max_context_len is None else max_context_len
    programs = B * KVH
    gluon = False
    if fmt == 2:
        kernel = FP4_KERNEL if fp4_kernel is None else fp4_kernel
        if kernel not in ("triton", "gluon"):
            raise ValueError(f"fp4_kernel must be 'triton' or 'gluon', got {kernel!r}")
        refusal = _gluon_fp4_refusal(q, G, block_n) if kernel == "gluon" else "not asked for"
        if refusal is not None and fp4_kernel == "gluon":
            raise ValueError(f"fp4_kernel='gluon' cannot run this call: {refusal}")
        gluon = refusal is None
    if gluon:  # 64-token tiles (32 for short contexts while the programs do not fill the SMs); no pipeline stages
        short = max_len <= FP4_SHORT_CONTEXT
        block_n = (32 if short and programs < _num_sms(q.device) else 64) if block_n is None else block_n
        if num_splits is None and not short:
            num_splits = triton.cdiv(GLUON_PROGRAMS_PER_SM * _num_sms(q.device), programs)
    if fmt == 2 and max_len <= FP4_SHORT_CONTEXT:  # a rollout's short contexts (FP4_SHORT_CONTEXT says why)
        block_n = (32 if programs < _num_sms(q.device) else 64) if block_n is None else block_n
        num_stages = 2 if num_stages is None else num_stages
    if fmt == 2 and num_splits is None and _num_sms(q.device) <= programs <= 4 * _num_sms(q.device):
        num_splits = 2  # one to four waves of programs: two splits (batch 64 at 2K: 141.4 -> 132.2 us, same sweep)
    block_n = BLOCK_N[kv_format] if block_n is None else block_n
    n_tiles = max(1, triton.cdiv(max_len, block_n))
    if num_splits is None:
        if fmt == 2:  # one full wave of FP4_PROGRAMS_PER_SM programs per SM
            num_splits = min(n_tiles, max(1, FP4_PROGRAMS_PER_SM * _num_sms(q.device) // (B * KVH)))
        else:
            num_splits = min(n_tiles, max(1, triton.cdiv(2 * _num_sms(q.device), B * KVH)))
    chunk = triton.cdiv(n_tiles, num_splits) * block_n
    num_splits = max(1, triton.cdiv(max_len, chunk))
    o_part = torch.empty(B * H * num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    ks_t, vs_t = (ks, vs) if ks is not None else (kd, vd)  # unused by the dense path
    sk = (ks_t.stride(0), ks_t.stride(1)) if ks is not None else (0, 0)
    sv = (vs_t.stride(0), vs_t.stride(1)) if vs is not None else (0, 0)
    use_dot = min(G_PAD, block_n, width) >= 16
    fp4_decode = FP4_DECODE if fp4_decode is None else fp4_decode
    if interpreted or q.device.type != "cuda":
        fp4_decode %= 2  # inline PTX runs compiled on CUDA only
    launch = {} if num_stages is None else {"num_stages": num_stages}
    sc_words = fmt == 2 and FP4_SC_WORDS and D % 64 == 0 and all(
        t.data_ptr() % 4 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0 for t in (ks, vs))
    if gluon:
        from model.kernels.decode_attention_gluon import fp4_decode_partial_kernel

        fp4_decode_partial_kernel[(B, KVH, num_splits)](
            q, kd, ks, vd, vs, block_table, context_lens, o_part, lse, sm_scale * LOG2E * fp4_gain, fp4_gain,
            q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), *sk, vd.stride(0), vd.stride(1), *sv,
            block_table.stride(0), chunk, num_splits, H=H, G=G, D=D, PAGE=block_size, BLOCK_N=block_n,
            PREFETCH=GLUON_PREFETCH, num_warps=4, **({"maxnreg": GLUON_MAXNREG} if GLUON_MAXNREG else {}))
    else:
        _decode_partial_kernel[(B, KVH, num_splits)](
            q, kd, ks_t, vd, vs_t, block_table, context_lens, o_part, lse,
            sm_scale * LOG2E * fp4_gain, fp4_gain,
            q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), *sk, vd.stride(0), vd.stride(1), *sv,
            block_table.stride(0), chunk, num_splits,
            H=H, G=G, G_PAD=G_PAD, D=D, PAGE=block_size, BLOCK_N=block_n, FMT=fmt, CD=cd_tl, IEEE=ieee or interpreted,
            USE_DOT=use_dot, FP4_DECODE=fp4_decode, SC_WORDS=sc_words, num_warps=num_warps, **launch,
        )
    _merge_splits_kernel[(B * H,)](o_part, lse, out, num_splits, D=D, S_PAD=triton.next_power_of_2(num_splits))
    return out

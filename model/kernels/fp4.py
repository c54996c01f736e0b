"""Triton kernels for the FP4 KV format: quantise (to packed E2M1 + E4M3 scales) and dequantise.

Bit-exact against the PyTorch reference in `model/fp4.py` (which documents the format). Scale blocks
are 16 contiguous values, so the tensor is processed as a flat sequence of blocks, `NBP` blocks per
program, whatever the row width; a program handles the 8 channel pairs of a block, one output byte
each. bf16 tensors move as int32 words (a channel pair per word), so widening, amax and the NaN test
are bit operations and a dequantised pair is one 32-bit store. The E2M1 encode is a three-comparison
binary search against exact midpoint products (no division; for bf16 input on CUDA it runs in PTX on
bf16x2 channel pairs, `_E2M1X2_ENCODE_ASM`); the decode places E2M1's bits in an fp16
(exact, see `e2m1_f16_bits`). Exactness tricks: no float8 casts (the interpreter's fp32 -> fp8 is not
round-to-nearest-even) and no approximate division / log2 / exp2: the one division is `div_rn`, the
E4M3 round-up works on float32 bits. On a machine without a GPU, tests run them with
TRITON_INTERPRET=1. The paged KV cache calls these on CUDA and the reference elsewhere (same contract,
`model.kv_cache._fp4_impl`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from model import fp4 as ref


@triton.jit
def _pow2(e):
    """2^e for integer-valued e in the float32 normal range, built from bits (exact on every backend)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_code(x, sc):
    """E2M1 code (sign in bit 3) of x / sc, ties to even, without forming the quotient.

    A binary search over the midpoints [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] · sc (exact products): a
    tie goes to the even code, so the comparison is >= against the midpoints whose upper neighbour has
    an even code (0.75, 1.75, 3.5) and > against the others. Three comparisons instead of seven plus a
    tie pass; a NaN x (or a NaN sc) compares false everywhere and gives code 0, as in the reference.
    """
    mag = tl.abs(x)
    c1 = mag >= 1.75 * sc
    c2 = mag >= tl.where(c1, 3.5 * sc, 0.75 * sc)
    c3 = mag > tl.where(c1, tl.where(c2, 5.0 * sc, 2.5 * sc), tl.where(c2, 1.25 * sc, 0.25 * sc))
    idx = c1.to(tl.int32) * 4 + c2.to(tl.int32) * 2 + c3.to(tl.int32)
    return tl.where((x < 0) & (idx > 0), idx + 8, idx)


# E2M1 encode of a bf16 channel pair in PTX ($1: the int32 word, channel 2j in the low half): the same
# binary search as _e2m1_code, on both halves at once with bf16x2 comparisons (`set` gives 0xFFFF / 0 per
# half; the midpoint products m·s have <= 7 significant bits, so they are exact in bf16 and so is every
# comparison); $2..$8 are the thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 times the scale as bf16x2
# (both halves equal). lop3 0xCA is a ? b : c. Returns the packed byte (low code | high code << 4).
_E2M1X2_ENCODE_ASM = tl.constexpr("""
{
.reg .b32 m, m1, m2, m3, t, u, v, s;
and.b32 m, $1, 0x7FFF7FFF;
set.ge.u32.bf16x2 m1, m, $5;
lop3.b32 t, m1, $7, $3, 0xCA;
set.ge.u32.bf16x2 m2, m, t;
lop3.b32 u, m2, $8, $6, 0xCA;
lop3.b32 v, m2, $4, $2, 0xCA;
lop3.b32 t, m1, u, v, 0xCA;
set.gt.u32.bf16x2 m3, m, t;
and.b32 u, m2, 0x00020002;
lop3.b32 u, m1, u, 0x00040004, 0xEC;
lop3.b32 u, m3, u, 0x00010001, 0xEC;
lop3.b32 v, m1, m2, m3, 0xFE;
shr.b32 s, $1, 12;
lop3.b32 s, s, v, 0x00080008, 0x80;
or.b32 u, u, s;
shr.b32 v, u, 12;
lop3.b32 $0, u, v, 0xFF, 0xA8;
}
""")


# Leaner encode (QUANT_V2): the same binary search, but the scale's magnitude word |x| ($2, computed once
# and shared with amax) and the sign come in separately; the sign of a nonzero code is one more bf16x2
# comparison, x < -0.25·s ($10: -0.25·s), which is false for -0, for |x| <= 0.25·s (code 0) and for NaN.
# The code bits are merged with lop3 0xE4 (c ? a : b, c a constant bit mask): bit 2 from m1, bit 1 from
# m2, bit 0 from m3, bits 3.. from the sign mask; then the two halves' nibbles are joined into the low
# byte (bits above it are junk, cut by the uint8 conversion). ~10 integer ops per pair instead of 14:
# the kernel is bound by the integer (ALU) pipe.
_E2M1X2_ENCODE_V2_ASM = tl.constexpr("""
{
.reg .b32 m1, m2, m3, n, t, u, v;
set.ge.u32.bf16x2 m1, $2, $6;
lop3.b32 t, m1, $8, $4, 0xCA;
set.ge.u32.bf16x2 m2, $2, t;
lop3.b32 u, m2, $9, $7, 0xCA;
lop3.b32 v, m2, $5, $3, 0xCA;
lop3.b32 t, m1, u, v, 0xCA;
set.gt.u32.bf16x2 m3, $2, t;
set.lt.u32.bf16x2 n, $1, $10;
lop3.b32 u, m1, m2, 0x00040004, 0xE4;
lop3.b32 u, u, m3, 0x00060006, 0xE4;
lop3.b32 u, u, n, 0x00070007, 0xE4;
shr.u32 t, u, 12;
lop3.b32 $0, u, t, 0x0000000F, 0xE4;
}
""")

# The eight bf16x2 thresholds m·s (m = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25) from the scale as
# bf16x2 ($8), by fma with -0 on the FMA pipe: every product is exact (<= 7 significant bits), NaN stays NaN.
_THRESHOLDS_ASM = tl.constexpr("""
{
.reg .b32 k, z;
mov.b32 z, 0x80008000;
mov.b32 k, 0x3E803E80;
fma.rn.bf16x2 $0, $8, k, z;
mov.b32 k, 0x3F403F40;
fma.rn.bf16x2 $1, $8, k, z;
mov.b32 k, 0x3FA03FA0;
fma.rn.bf16x2 $2, $8, k, z;
mov.b32 k, 0x3FE03FE0;
fma.rn.bf16x2 $3, $8, k, z;
mov.b32 k, 0x40204020;
fma.rn.bf16x2 $4, $8, k, z;
mov.b32 k, 0x40604060;
fma.rn.bf16x2 $5, $8, k, z;
mov.b32 k, 0x40A040A0;
fma.rn.bf16x2 $6, $8, k, z;
mov.b32 k, 0xBE80BE80;
fma.rn.bf16x2 $7, $8, k, z;
}
""")


@triton.jit
def _max_u16x2(a, b):
    """Per-half unsigned max of two int32 words (one instruction on sm_90)."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _bf16x2_dup(f):
    """float32 f that is exact in bf16 -> int32 holding its bf16 bits in both halves."""
    b = f.to(tl.int32, bitcast=True)
    return (b & -65536) | ((b >> 16) & 0xFFFF)


@triton.jit
def _block_scale(amax, has_nan):
    """A block's E4M3 scale from its float32 amax: (the scale as float32, its E4M3 bits; a NaN block's bits are
    E4M3 NaN, 0x7F, and its scale 1)."""
    s = tl.minimum(tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125), 448.0)  # [2^-9, 448], IEEE /
    s = tl.where(has_nan, 1.0, s)
    # Round the scale *up* to E4M3 from the float32 bits (no float8 conversion: exact on every backend).
    # Normal range (>= 2^-6): keep 3 mantissa bits, rounding up (a carry into the exponent is right);
    # subnormal range: multiples of 2^-9.
    sub = s < 0.015625
    up = (s.to(tl.int32, bitcast=True) + 0xFFFFF) & -1048576  # 0xFFF00000
    sub_m = tl.ceil(s * 512.0)
    scale = tl.where(sub, sub_m * 0.001953125, up.to(tl.float32, bitcast=True))
    bits = tl.where(sub, sub_m.to(tl.int32), (up >> 20) - 960)  # E4M3 exponent field = float32's - 120
    bits = tl.where(has_nan, 0x7F, bits)  # E4M3 NaN: the block dequantises to NaN
    return scale, bits


@triton.jit
def encode_pairs(lo, hi):
    """Channel pairs (2j, 2j + 1) of NB 16-value blocks, float32 lo (even) and hi (odd) [NB, 8] -> (packed bytes
    [NB, 8], E4M3 scale bits [NB]) as uint8: what `quantize` stores for them (the Triton encode), for a kernel
    that has the values in registers (model/kernels/decode_fused.py writes K and V this way)."""
    has_nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), axis=1) > 0
    amax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1)
    scale, bits = _block_scale(amax, has_nan)
    sc = tl.where(has_nan, float("nan"), scale)[:, None]  # NaN block: every code 0, as in the reference
    return (_e2m1_code(lo, sc) | (_e2m1_code(hi, sc) << 4)).to(tl.uint8), bits.to(tl.uint8)


@triton.jit
def _quantize_kernel(x_ptr, packed_ptr, scale_ptr, n_blocks, rows_ptr, blocks_per_row, NBP: tl.constexpr,
                     BF16_WORDS: tl.constexpr, ASM: tl.constexpr = False, V2: tl.constexpr = False,
                     SCATTER: tl.constexpr = False, x2_ptr=None, packed2_ptr=None, scale2_ptr=None,
                     x_row_stride=0, x2_row_stride=0, PAIR: tl.constexpr = False, STRIDED: tl.constexpr = False):
    # PAIR: program_id(1) == 1 encodes a second tensor of the same shape (V beside K) into its own pools.
    # STRIDED: input row r (blocks_per_row blocks) starts at r · x_row_stride (words or values), not r · its width.
    if PAIR:
        if tl.program_id(1) == 1:
            x_ptr = x2_ptr
            packed_ptr = packed2_ptr
            scale_ptr = scale2_ptr
            x_row_stride = x2_row_stride
    # 64-bit arithmetic once per program (the base pointers); per-element offsets are int32
    first = tl.program_id(0).to(tl.int64) * NBP
    blk = tl.arange(0, NBP)  # block ids within the program
    live = blk < n_blocks - first
    if STRIDED:
        src_in = first + blk
        if BF16_WORDS:
            xblk = (src_in // blocks_per_row) * x_row_stride + (src_in % blocks_per_row) * 8
        else:
            xblk = (src_in // blocks_per_row) * x_row_stride + (src_in % blocks_per_row) * 16
    else:
        if BF16_WORDS:
            x_ptr += first * 8
            xblk = blk * 8
        else:
            x_ptr += first * 16
            xblk = blk * 16
    if SCATTER:  # block b of input row r goes to block b of output row rows[r] (a paged cache's slot)
        src = first + blk
        row = tl.load(rows_ptr + src // blocks_per_row, mask=live, other=0)
        dst = row * blocks_per_row + src % blocks_per_row
        packed_ptr += dst[:, None] * 8
        scale_ptr += dst
    else:
        packed_ptr += first * 8 + blk[:, None] * 8
        scale_ptr += first + blk
    pair = tl.arange(0, 8)  # channel pairs (2j, 2j+1) of a block: one output byte each
    if BF16_WORDS:
        # x_ptr is the bf16 tensor viewed as int32: word j holds channel 2j (low half), 2j+1 (high half).
        # Widening bf16 to float32 is a shift, and |x| is ordered like its bits, so amax and the NaN
        # test are integer max / compare (full rate) instead of float work per value.
        w = tl.load(x_ptr + xblk[:, None] + pair[None, :], mask=live[:, None], other=0)
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
        if V2:  # PTX: |x| words once (shared with the encode), amax by per-half max (u16x2)
            mw = w & 0x7FFF7FFF
            mm = tl.reduce(mw, 1, _max_u16x2)
            mbits = tl.maximum(mm & 0xFFFF, mm >> 16)
        else:
            mbits = tl.max(tl.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF), axis=1)
        has_nan = mbits > 0x7F80
        amax = (mbits << 16).to(tl.float32, bitcast=True)  # inf stays inf
    else:
        offs = xblk[:, None] + 2 * pair[None, :]
        lo = tl.load(x_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + offs + 1, mask=live[:, None], other=0.0).to(tl.float32)
        has_nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), axis=1) > 0
        amax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1)
    scale, bits = _block_scale(amax, has_nan)
    tl.store(scale_ptr, bits.to(tl.uint8), mask=live)
    if V2:  # bf16 words, PTX only
        t = tl.inline_asm_elementwise(_THRESHOLDS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r",
                                      [_bf16x2_dup(tl.where(has_nan, float("nan"), scale))],
                                      dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        packed = tl.inline_asm_elementwise(
            _E2M1X2_ENCODE_V2_ASM, "=r,r,r,r,r,r,r,r,r,r,r",
            [w, mw, t[0][:, None], t[1][:, None], t[2][:, None], t[3][:, None], t[4][:, None], t[5][:, None],
             t[6][:, None], t[7][:, None]],
            dtype=tl.int32, is_pure=True, pack=1).to(tl.uint8)
        tl.store(packed_ptr + pair[None, :], packed, mask=live[:, None])
        return
    sc = tl.where(has_nan, float("nan"), scale)[:, None]  # NaN block: every code 0, as in the reference
    if ASM:  # bf16 words only
        packed = tl.inline_asm_elementwise(
            _E2M1X2_ENCODE_ASM, "=r,r,r,r,r,r,r,r,r",
            [w, _bf16x2_dup(0.25 * sc), _bf16x2_dup(0.75 * sc), _bf16x2_dup(1.25 * sc), _bf16x2_dup(1.75 * sc),
             _bf16x2_dup(2.5 * sc), _bf16x2_dup(3.5 * sc), _bf16x2_dup(5.0 * sc)],
            dtype=tl.int32, is_pure=True, pack=1).to(tl.uint8)
    else:
        packed = (_e2m1_code(lo, sc) | (_e2m1_code(hi, sc) << 4)).to(tl.uint8)
    tl.store(packed_ptr + pair[None, :], packed, mask=live[:, None])


@triton.jit
def _e2m1_bits(code):
    """float32 bits of the E2M1 value of a 4-bit code: magnitudes 1..6 are (idx + 252) << 22, 0.5 is
    one below that pattern's 0.75, 0 is 0; bit 3 is the sign."""
    idx = code & 7
    mag = tl.where(idx == 0, 0, (idx + 252 - (idx == 1).to(tl.int32)) << 22)
    return mag | ((code & 8) << 28)


# E2M1 -> fp16 in PTX, 4 bytes (8 values) per call: $4 holds bytes b0..b3, $5 / $6 the fp16 scales of
# elements (0, 1) / (2, 3); out $0 / $1 = low nibbles of (b0, b1) / (b2, b3), $2 / $3 = high nibbles,
# each an f16x2. A nibble is moved to the top of a zeroed byte by `and` (+ `shl` for the low ones), then
# `prmt` spreads two bytes into the upper bytes of the halves: the sign lands on bit 15 and the
# magnitude's bits (12..14) are copied down to 9..11 by one shift and one `lop3` ((y | y >> 3) & mask),
# which gives the fp16 bits (c & 7) << 9 | (c & 8) << 12 of e2m1_f16_bits; then one mul.f16x2 per pair.
E2M1X8_F16_PTX = """
{
.reg .b32 xh, xl, y, z;
and.b32 xh, $4, 0xF0F0F0F0;
shl.b32 xl, $4, 4;
and.b32 xl, xl, 0xF0F0F0F0;
prmt.b32 y, xl, 0, 0x1404;
shr.b32 z, y, 3;
lop3.b32 $0, y, z, 0x8E008E00, 0xA8;
prmt.b32 y, xl, 0, 0x3424;
shr.b32 z, y, 3;
lop3.b32 $1, y, z, 0x8E008E00, 0xA8;
prmt.b32 y, xh, 0, 0x1404;
shr.b32 z, y, 3;
lop3.b32 $2, y, z, 0x8E008E00, 0xA8;
prmt.b32 y, xh, 0, 0x3424;
shr.b32 z, y, 3;
lop3.b32 $3, y, z, 0x8E008E00, 0xA8;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $6;
}
"""


@triton.jit
def e2m1_f16_bits(code):
    """Low nibble of `code` -> fp16 holding E2M1(nibble) · 2^-14 exactly: E2M1's exponent and mantissa
    bits placed at fp16's (bits 11..9), its sign at bit 15; 0.5 lands on fp16's subnormal 2^-15."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_value(code):
    return _e2m1_bits(code).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(bits):
    """E4M3 (fn) bit pattern -> float32, decoded arithmetically; 0x7F / 0xFF are NaN."""
    b = bits & 0x7F
    ex = b >> 3
    m = (b & 7).to(tl.float32)
    normal = _pow2(ex - 7) * (1.0 + m * 0.125)
    v = tl.where(ex == 0, m * 0.001953125, normal)
    v = tl.where(bits >= 0x80, -v, v)
    return tl.where(b == 0x7F, float("nan"), v)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, n_blocks, NBP: tl.constexpr, BF16_WORDS: tl.constexpr,
                       F16_DECODE: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * NBP
    packed_ptr += first * 8
    scale_ptr += first
    if BF16_WORDS:
        out_ptr += first * 8
    else:
        out_ptr += first * 16
    blk = tl.arange(0, NBP)
    live = blk < n_blocks - first
    pair = tl.arange(0, 8)
    p = tl.load(packed_ptr + blk[:, None] * 8 + pair[None, :], mask=live[:, None], other=0).to(tl.int32)
    sc = _e4m3_value(tl.load(scale_ptr + blk, mask=live, other=0).to(tl.int32))[:, None]
    if F16_DECODE:
        # E2M1 bits placed in an fp16 give E2M1 · 2^-14 exactly (decode_attention.py explains); the
        # 2^14 goes into the per-block scale, so a value costs a few bit ops, a convert and a multiply
        sc = sc * 16384.0
        lo = e2m1_f16_bits(p).to(tl.float32) * sc
        hi = e2m1_f16_bits(p >> 4).to(tl.float32) * sc
    else:
        lo = _e2m1_value(p & 15) * sc  # exact: 2 x 4 significant bits, in bf16's range
        hi = _e2m1_value(p >> 4) * sc
    if BF16_WORDS:
        # the products are exact in bf16, so bf16 is the top half of the float32 bits; one int32 store
        # writes the channel pair (2j in the low half, 2j + 1 in the high half)
        word = ((lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (hi.to(tl.int32, bitcast=True) & -65536)
        tl.store(out_ptr + blk[:, None] * 8 + pair[None, :], word, mask=live[:, None])
    else:
        offs = blk[:, None] * 16 + 2 * pair[None, :]
        tl.store(out_ptr + offs, lo.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(out_ptr + offs + 1, hi.to(out_ptr.dtype.element_ty), mask=live[:, None])


# Launch shape: scale blocks (of 16 values) per program and warps; the bench's --sweep varies them.
QUANT_NBP, QUANT_WARPS = 256, 4
QUANT_ASM = True  # bf16 input on CUDA: the E2M1 encode in PTX (_E2M1X2_ENCODE_ASM); the interpreter never
QUANT_V2 = True  # with QUANT_ASM: u16x2 amax, bf16x2 fma thresholds, the leaner encode (_E2M1X2_ENCODE_V2_ASM)
DEQUANT_NBP, DEQUANT_WARPS = 128, 4
DEQUANT_F16_DECODE = True  # E2M1 via fp16 bit placement (False: the float32 bit pattern path)


def _launch_quantize(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None,
                     blocks_per_row: int) -> None:
    """The quantise kernel over x's 16-value blocks into flat uint8 `packed` / `scales`; with `rows`, block b of
    x's row r lands in block b of output row rows[r] (`blocks_per_row` blocks a row)."""
    flat = x.contiguous().view(-1)
    words = flat.dtype == torch.bfloat16
    if words:
        flat = flat.view(torch.int32)
    n_blocks = x.numel() // ref.BLOCK
    if n_blocks:
        asm = QUANT_ASM and words and x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
        _quantize_kernel[(triton.cdiv(n_blocks, QUANT_NBP),)](
            flat, packed, scales, n_blocks, scales if rows is None else rows.contiguous(), blocks_per_row, NBP=QUANT_NBP,
            BF16_WORDS=words, ASM=asm, V2=asm and QUANT_V2, SCATTER=rows is not None, num_warps=QUANT_WARPS)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as model.fp4.quantize: x [..., C] -> (uint8 [..., C // 2], float8_e4m3fn [..., C // 16])."""
    C = x.shape[-1]
    if C % ref.BLOCK:
        raise ValueError(f"last dimension {C} is not a multiple of {ref.BLOCK}")
    n_blocks = x.numel() // ref.BLOCK
    packed = torch.empty(n_blocks * 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.uint8, device=x.device)
    _launch_quantize(x, packed, scales, None, 1)
    return packed.view(*x.shape[:-1], C // 2), scales.view(torch.float8_e4m3fn).view(*x.shape[:-1], C // ref.BLOCK)


def quantize_into(x: torch.Tensor, packed_pool: torch.Tensor, scale_pool: torch.Tensor, rows: torch.Tensor) -> None:
    """`quantize(x)` written straight into rows of a pool, in one kernel (the paged cache's fp4 write without the
    temporary encoding and its two index copies): x [N, ...] -> packed_pool[rows[n]] and scale_pool[rows[n]]
    (pools [R, ...] uint8, each row the width `quantize` gives x[n]); rows [N] int64 in [0, R)."""
    per_row = x[0].numel() if x.shape[0] else 0
    if per_row % ref.BLOCK:
        raise ValueError(f"row width {per_row} is not a multiple of {ref.BLOCK}")
    if not (packed_pool.is_contiguous() and scale_pool.is_contiguous() and packed_pool.dtype == scale_pool.dtype == torch.uint8
            and packed_pool[0].numel() * 2 == per_row and scale_pool[0].numel() * ref.BLOCK == per_row):
        raise ValueError("pools must be contiguous uint8 rows of the packed and scale widths of one x row")
    _launch_quantize(x, packed_pool.view(-1), scale_pool.view(-1), rows, per_row // ref.BLOCK)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """x [N, ...] whose rows are each contiguous (a view into a wider tensor, e.g. V inside the fused qkv
    output) -> (x as the kernel reads it: int32 words for bf16, else itself; the row stride in those units), or
    None when the kernel cannot read it in place."""
    if x.shape[0] == 0 or not x[0].is_contiguous() or x.stride(0) < x[0].numel():
        return None
    if x.dtype != torch.bfloat16:
        return x, x.stride(0)
    if x.stride(0) % 2 or x.storage_offset() % 2 or x.shape[-1] % 2:
        return None
    return x.view(torch.int32), x.stride(0) // 2


def quantize_pair_into(k: torch.Tensor, v: torch.Tensor, k_pools: tuple[torch.Tensor, torch.Tensor],
                       v_pools: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> None:
    """`quantize_into(k, *k_pools, rows)` and `quantize_into(v, *v_pools, rows)` in one kernel launch, reading
    rows that are contiguous each but strided (V as a view of the fused qkv output) without copying them first:
    a decode step's FP4 cache write was two launches and a copy of V per layer (BENCHMARKS.md, "Eighth step")."""
    views = [_rows_view(x) for x in (k, v)]
    per_row = k[0].numel() if k.shape[0] else 0
    if any(w is None for w in views) or k.shape != v.shape or k.dtype != v.dtype or per_row % ref.BLOCK:
        quantize_into(k, *k_pools, rows)
        quantize_into(v, *v_pools, rows)
        return
    for packed_pool, scale_pool in (k_pools, v_pools):
        if not (packed_pool.is_contiguous() and scale_pool.is_contiguous() and packed_pool.dtype == scale_pool.dtype == torch.uint8
                and packed_pool[0].numel() * 2 == per_row and scale_pool[0].numel() * ref.BLOCK == per_row):
            raise ValueError("pools must be contiguous uint8 rows of the packed and scale widths of one x row")
    (xk, k_stride), (xv, v_stride) = views
    words = k.dtype == torch.bfloat16
    n_blocks = k.numel() // ref.BLOCK
    asm = QUANT_ASM and words and k.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    _quantize_kernel[(triton.cdiv(n_blocks, QUANT_NBP), 2)](
        xk, k_pools[0].view(-1), k_pools[1].view(-1), n_blocks, rows.contiguous(), per_row // ref.BLOCK, NBP=QUANT_NBP,
        BF16_WORDS=words, ASM=asm, V2=asm and QUANT_V2, SCATTER=True, x2_ptr=xv, packed2_ptr=v_pools[0].view(-1),
        scale2_ptr=v_pools[1].view(-1), x_row_stride=k_stride, x2_row_stride=v_stride, PAIR=True, STRIDED=True,
        num_warps=QUANT_WARPS)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    C = packed.shape[-1] * 2
    n_blocks = scales.numel()
    out = torch.empty(n_blocks * ref.BLOCK, dtype=dtype, device=packed.device)
    words = dtype == torch.bfloat16
    if n_blocks:
        _dequantize_kernel[(triton.cdiv(n_blocks, DEQUANT_NBP),)](
            packed.contiguous().view(-1), scales.contiguous().view(torch.uint8).view(-1),
            out.view(torch.int32) if words else out, n_blocks, NBP=DEQUANT_NBP, BF16_WORDS=words,
            F16_DECODE=DEQUANT_F16_DECODE, num_warps=DEQUANT_WARPS)
    return out.view(*packed.shape[:-1], C)

"""Triton kernels for the FP4 KV format: quantise (to packed E2M1 + E4M3 scales) and dequantise.

Bit-exact against the PyTorch reference in `model/fp4.py` (which documents the format). Scale blocks
are 16 contiguous values, so the tensor is processed as a flat sequence of blocks, `NBP` blocks per
program, whatever the row width. On a machine without a GPU, tests run
them with TRITON_INTERPRET=1. `use_triton(x)` is the opt-in switch: the reference is the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model import fp4 as ref


@triton.jit
def _pow2(e):
    """2^e for integer-valued e in the float32 normal range, built from bits (exact on every backend)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(s):
    """floor(log2(s)) for positive normal float32 s, read from the exponent bits (exact)."""
    return (((s.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127).to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, packed_ptr, scale_ptr, n_blocks, NBP: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * NBP + tl.arange(0, NBP)  # [NBP] global block ids
    live = blk < n_blocks
    x = tl.load(x_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    absx = tl.abs(x)
    amax = tl.max(absx, axis=1)  # inf stays inf; NaN handled below
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    s = tl.minimum(tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125), 448.0)  # [2^-9, 448], IEEE /
    s = tl.where(has_nan, 1.0, s)
    # Round the scale *up* to E4M3 arithmetically (no float8 conversion: exact on every backend).
    # In the binade [2^e, 2^(e+1)) E4M3 steps by 2^(e-3); below 2^-6 (subnormals) by 2^-9.
    e = _floor_log2(s)
    step = _pow2(tl.maximum(e, -6.0) - 3.0)
    scale = tl.minimum(tl.ceil(tl.math.div_rn(s, step)) * step, 448.0)
    e = _floor_log2(scale)  # the binade of the rounded value (it may have moved up)
    sub = scale < 0.015625
    bits = tl.where(sub, scale * 512.0, 8.0 * (e + 6.0) + 8.0 * tl.math.div_rn(scale, _pow2(e))).to(tl.int32)
    bits = tl.where(has_nan, 0x7F, bits)  # E4M3 NaN: the block dequantises to NaN
    tl.store(scale_ptr + blk, bits.to(tl.uint8), mask=live)
    # E2M1 code = number of midpoints below |x| / scale, ties to the even code; compared as
    # |x| vs midpoint · scale (exact products), so no division is needed
    mag = tl.where(x != x, 0.0, tl.abs(x))
    sc = scale[:, None]
    idx = ((mag > 0.25 * sc).to(tl.int32) + (mag > 0.75 * sc).to(tl.int32) + (mag > 1.25 * sc).to(tl.int32)
           + (mag > 1.75 * sc).to(tl.int32) + (mag > 2.5 * sc).to(tl.int32) + (mag > 3.5 * sc).to(tl.int32)
           + (mag > 5.0 * sc).to(tl.int32))
    tie = ((mag == 0.25 * sc) | (mag == 0.75 * sc) | (mag == 1.25 * sc) | (mag == 1.75 * sc) | (mag == 2.5 * sc)
           | (mag == 3.5 * sc) | (mag == 5.0 * sc))
    idx = idx + (tie & ((idx % 2) == 1)).to(tl.int32)
    code = idx + 8 * ((x < 0) & (idx > 0)).to(tl.int32)
    lo, hi = tl.split(tl.reshape(code, (NBP, 8, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    tl.store(packed_ptr + blk[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=live[:, None])


@triton.jit
def _e2m1_value(code):
    idx = code & 7
    e = idx >> 1
    m = (idx & 1).to(tl.float32)
    normal = _pow2(e - 1) * (1.0 + 0.5 * m)
    mag = tl.where(idx < 2, 0.5 * m, normal)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _e4m3_value(bits):
    """E4M3 (fn) bit pattern -> float32, decoded arithmetically; 0x7F is NaN."""
    ex = bits >> 3
    m = (bits & 7).to(tl.float32)
    normal = _pow2(ex - 7) * (1.0 + m * 0.125)
    v = tl.where(ex == 0, m * 0.001953125, normal)
    return tl.where(bits == 0x7F, float("nan"), v)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, n_blocks, NBP: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * NBP + tl.arange(0, NBP)
    live = blk < n_blocks
    p = tl.load(packed_ptr + blk[:, None] * 8 + tl.arange(0, 8)[None, :], mask=live[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(p & 15, p >> 4), (NBP, 16))
    bits = tl.load(scale_ptr + blk, mask=live, other=0).to(tl.int32)
    vals = _e2m1_value(codes) * _e4m3_value(bits)[:, None]
    tl.store(out_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :], vals.to(out_ptr.dtype.element_ty), mask=live[:, None])


NBP = 128  # scale blocks (of 16 values) per program


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as model.fp4.quantize: x [..., C] -> (uint8 [..., C // 2], float8_e4m3fn [..., C // 16])."""
    C = x.shape[-1]
    if C % ref.BLOCK:
        raise ValueError(f"last dimension {C} is not a multiple of {ref.BLOCK}")
    flat = x.contiguous().view(-1)
    n_blocks = flat.numel() // ref.BLOCK
    packed = torch.empty(n_blocks * 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.uint8, device=x.device)
    if n_blocks:
        _quantize_kernel[(triton.cdiv(n_blocks, NBP),)](flat, packed, scales, n_blocks, NBP=NBP)
    return packed.view(*x.shape[:-1], C // 2), scales.view(torch.float8_e4m3fn).view(*x.shape[:-1], C // ref.BLOCK)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    C = packed.shape[-1] * 2
    n_blocks = scales.numel()
    out = torch.empty(n_blocks * ref.BLOCK, dtype=dtype, device=packed.device)
    if n_blocks:
        _dequantize_kernel[(triton.cdiv(n_blocks, NBP),)](packed.contiguous().view(-1),
                                                          scales.contiguous().view(torch.uint8).view(-1), out, n_blocks, NBP=NBP)
    return out.view(*packed.shape[:-1], C)

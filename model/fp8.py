"""FP8 (E4M3) KV-cache format for the sliding-window KV, plain-PyTorch reference (issue #5).

Seed §2.4.4 keeps FP8 for the SWA KV cache ("due to its sensitivity to quantization") while the main KV
goes to FP4. The layout here: every row (one token of one KV head, D channels) is stored as D E4M3 (fn)
values plus one E8M0 scale byte, a power of two: D + 1 bytes per row, 8 + 8 / D bits per value.

- Scale: 2^e with e the smallest integer such that amax(row) / 2^e <= 448 (the largest E4M3), so no
  finite value saturates. e is clamped to [-126, 126] (a float32 amax needs at most 120): the scale byte
  is then a float32 exponent field (e + 127, 1..253) and 2^±e float32 normals, so x · 2^-e and q · 2^e
  are exact (a power of two),
  and the only rounding is the E4M3 one. Rows with amax < 448 · 2^-126 lose their smallest values.
  An all-zero row gets scale 2^0.
- Rounding of x / 2^e to E4M3: to nearest, ties to even (E4M3 subnormals down to 2^-9; below 2^-10 ->
  0). The sign of zero is kept (-0 stays -0).
- Non-finite input: ±inf saturates to ±448 · scale, the scale coming from the row's finite values; a
  NaN makes the row's scale byte 0xFF (NaN), so the whole row dequantises to NaN.
- Dequantised values are E4M3 · 2^e: 4 significant bits, exact in bf16 (and float32).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
SCALE_NAN = 0xFF
MIN_EXP, MAX_EXP = -126, 126


def bytes_per_row(head_dim: int) -> int:
    """Bytes of one cached row (one token, one KV head): D values + one scale byte."""
    return head_dim + 1


def row_scale_exponents(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> e [...] (int32): the smallest e in [-126, 126] with amax(|finite x|) <= 448 · 2^e."""
    a = x.float().abs()
    amax = torch.where(a.isinf() | a.isnan(), torch.zeros_like(a), a).amax(-1)
    mant, k = torch.frexp(amax)  # amax = mant · 2^k, mant in [0.5, 1); 448 · 2^(k-9) = 0.875 · 2^k
    e = k - 9 + (mant > 0.875).to(k.dtype)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    return e.clamp(MIN_EXP, MAX_EXP).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-126, 126], built from the exponent bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values float8_e4m3fn [..., D], scale bytes uint8 [...]: e + 127, 0xFF = NaN)."""
    e = row_scale_exponents(x)
    y = x.float() * _pow2(-e)[..., None]  # exact: a power of two, results in float32's normal range or 0
    y = y.clamp(-E4M3_MAX, E4M3_MAX)  # only ±inf (and NaN, untouched) reach the clamp
    values = y.to(torch.float8_e4m3fn)
    bits = (e + 127).to(torch.uint8)
    bits = torch.where(x.isnan().any(-1), torch.full_like(bits, SCALE_NAN), bits)
    return values, bits


def scale_values(scale_bits: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes -> float32 2^(b - 127); 0xFF -> NaN."""
    b = scale_bits.to(torch.int32)
    s = (b << 23).view(torch.float32)
    return torch.where(b == SCALE_NAN, torch.full_like(s, float("nan")), s)


def dequantize(values: torch.Tensor, scale_bits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (values.float() * scale_values(scale_bits)[..., None]).to(dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """quantise -> dequantise, the round trip the SWA cache applies (QAT's forward)."""
    return dequantize(*quantize(x), dtype=x.dtype)

"""FP4 KV-cache format, plain-PyTorch reference (seed §2.4.4). Issue #5, step 1: the format itself.

Values: E2M1, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (codes 0..7 in that order, sign in bit 3), two
per byte: the even channel in the low nibble, the odd channel in the high nibble. One E4M3 (fn) scale
per 16 contiguous channels, no global scale: 4 + 8/16 = 4.5 bits per value.

- Scale: amax(block) / 6, rounded *up* to the next E4M3 value, so |x| / scale <= 6 and no finite value
  saturates (except when amax / 6 exceeds 448, the largest E4M3: then the scale is 448 and the values
  clamp to ±6·448). An all-zero block gets the smallest E4M3 subnormal, 2^-9, as its scale; a scale
  below that is raised to it (values that small then round to 0).
- Rounding of x / scale to E2M1: to nearest, ties to even (the even code: 0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). 0.5 is E2M1's only subnormal; below 0.25 -> 0.
  -0 encodes as +0. The quotient is never formed: |x| is compared with midpoint · scale, a product
  that is exact in float32 (3 and 4 significant bits), so the rounding is of the true x / scale and
  needs no division (which GPUs only approximate by default).
- Non-finite input: ±inf saturates to ±6·448 (its block's scale is 448); a NaN makes its block's scale
  NaN, so the whole block dequantises to NaN and the fault stays visible instead of turning into zeros.
"""

from __future__ import annotations

import torch

BLOCK = 16
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2  # [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
BITS_PER_VALUE = 4 + 8 / BLOCK


def _e4m3_round_up(s: torch.Tensor) -> torch.Tensor:
    """Smallest E4M3 (fn) value >= s for finite s in [2^-9, 448]; float32 in, float8 out."""
    q = s.to(torch.float8_e4m3fn)
    below = q.float() < s
    bits = q.view(torch.uint8)
    bumped = (bits + below.to(torch.uint8)).view(torch.float8_e4m3fn)  # next code up (positive values)
    return bumped


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] (C a multiple of 16) -> E4M3 scales [..., C // 16]."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    finite_amax = torch.where(blocks.isinf(), torch.full_like(blocks, float("inf")), blocks.abs()).amax(-1)
    s = (finite_amax / 6.0).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)  # inf -> 448, 0 -> 2^-9
    scales = _e4m3_round_up(torch.nan_to_num(s, nan=1.0)).float()
    scales = torch.where(blocks.isnan().any(-1), torch.full_like(scales, float("nan")), scales)
    return scales.to(torch.float8_e4m3fn)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Scaled values (|y| <= 6 expected; larger saturates) -> 4-bit codes (uint8), ties to even."""
    mag = y.abs().clamp(max=6.0).nan_to_num(0.0)
    mids = _MIDPOINTS.to(y.device)
    idx = (mag[..., None] > mids).sum(-1)  # round half down ...
    tie = (mag[..., None] == mids).any(-1) & (idx % 2 == 1)
    idx = idx + tie.to(idx.dtype)  # ... then a tie onto an odd code moves up to the even one
    sign = (y < 0) & (idx > 0)
    return (idx + 8 * sign.to(idx.dtype)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    vals = E2M1_VALUES.to(codes.device)[(codes & 7).long()]
    return torch.where(codes >= 8, -vals, vals)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (packed uint8 [..., C // 2], E4M3 scales [..., C // 16])."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {BLOCK}")
    scales = block_scales(x)
    xb = x.float().unflatten(-1, (-1, BLOCK))
    thresholds = _MIDPOINTS.to(x.device) * scales.float()[..., None, None]  # [..., NB, 1, 7], exact
    mag = xb.abs().nan_to_num(0.0)[..., None]
    idx = (mag > thresholds).sum(-1)
    tie = (mag == thresholds).any(-1) & (idx % 2 == 1)
    idx = idx + tie.to(idx.dtype)
    codes = (idx + 8 * ((xb < 0) & (idx > 0)).to(idx.dtype)).to(torch.uint8).flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
    vals = e2m1_decode(codes).unflatten(-1, (-1, BLOCK)) * scales.float()[..., None]
    return vals.flatten(-2).to(dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """quantise -> dequantise, the round trip the cache applies (QAT's forward)."""
    return dequantize(*quantize(x), dtype=x.dtype)

"""FP8 (E4M3 + one power-of-two scale per row) reference format: scale choice, rounding, specials."""

import torch

from model.fp8 import E4M3_MAX, SCALE_NAN, bytes_per_row, dequantize, fake_quantize, quantize, row_scale_exponents, scale_values

# every finite non-negative E4M3 (fn) value, by code (0x00..0x7E)
_GRID = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _nearest_even(y: torch.Tensor) -> torch.Tensor:
    """Brute force: the E4M3 value nearest |y|, ties to the even code, sign restored."""
    d = (y.abs()[:, None] - _GRID[None, :]).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best
    code = torch.where(cand.sum(-1) > 1, cand.int().argmax(-1) + (cand.int().argmax(-1) % 2), cand.int().argmax(-1))
    return torch.copysign(_GRID[code], y)


def test_rounding_is_to_nearest_ties_to_even_against_brute_force():
    torch.manual_seed(0)
    mids = (_GRID[1:] + _GRID[:-1]) / 2  # every tie between neighbouring E4M3 values
    y = torch.cat([mids, -mids, torch.rand(2000) * 448, -torch.rand(500) * 2**-6, mids + 1e-6, mids - 1e-6])
    x = torch.cat([y, torch.full((12 - y.numel() % 12,), 448.0)]).view(-1, 12)
    x[:, 0] = 448.0  # amax 448: scale 2^0, so the stored value is the rounding of x itself
    v, sb = quantize(x)
    assert (sb == 127).all()
    assert torch.equal(v.float(), _nearest_even(x.flatten()).view_as(x))
    assert v.float()[0, 1:].abs().ne(0).any()  # the grid of ties really was exercised (not all zeros)


def test_scale_is_the_smallest_power_of_two_that_avoids_saturation():
    torch.manual_seed(1)
    x = torch.randn(200, 64) * torch.logspace(-30, 30, 200)[:, None]
    x[7] = 0.0
    x[8, 3] = 448 * 2.0**5  # amax exactly on a boundary: 2^5 suffices
    e = row_scale_exponents(x)
    amax = x.abs().amax(-1)
    live = amax > 0
    assert (amax[live] / 2.0 ** e[live].double() <= E4M3_MAX).all()
    assert (amax[live] / 2.0 ** (e[live].double() - 1) > E4M3_MAX).all()  # one smaller would saturate
    assert e[7] == 0 and e[8] == 5
    v, sb = quantize(x)
    assert v.dtype == torch.float8_e4m3fn and v.shape == x.shape and sb.dtype == torch.uint8 and sb.shape == (200,)
    assert torch.equal(scale_values(sb), 2.0 ** e.float())
    # error at most half an E4M3 step: 2^-4 relative for normals, 2^-10 · scale absolutely for subnormals
    y = dequantize(v, sb)
    s = scale_values(sb)[:, None]
    assert ((y - x).abs() <= torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)).all()


def test_quantize_of_dequantized_is_identity_and_bf16_output_is_exact():
    torch.manual_seed(2)
    x = torch.randn(16, 128) * 3
    v, sb = quantize(x)
    # the round trip is a projection (values; the scale may drop by 2 when the row max rounded down)
    assert torch.equal(fake_quantize(dequantize(v, sb)), dequantize(v, sb))
    assert torch.equal(dequantize(v, sb, torch.bfloat16).float(), dequantize(v, sb))
    assert torch.equal(fake_quantize(x.to(torch.bfloat16)).float(), fake_quantize(x.to(torch.bfloat16).float()))


def test_zeros_tiny_rows_inf_and_nan():
    z = torch.zeros(2, 8)
    z[1, 2] = -0.0
    v, sb = quantize(z)
    assert (sb == 127).all() and torch.equal(dequantize(v, sb), z) and dequantize(v, sb)[1, 2].item() == 0.0
    assert torch.signbit(dequantize(v, sb)[1, 2])  # -0 is kept
    tiny = torch.full((1, 8), 1e-38)  # below 448 · 2^-126: the exponent clamps at -126
    assert row_scale_exponents(tiny).item() == -126
    assert torch.allclose(fake_quantize(tiny), tiny, rtol=2**-4)
    x = torch.tensor([[1.0, float("inf"), -float("inf"), 0.5], [1.0, 2.0, float("nan"), 3.0]])
    v, sb = quantize(x)
    y = dequantize(v, sb)
    assert sb[0].item() == 127 - 8  # scale from the finite values only: amax 1 -> 2^-8
    assert y[0].tolist() == [1.0, E4M3_MAX * 2**-8, -E4M3_MAX * 2**-8, 0.5]
    assert sb[1].item() == SCALE_NAN and y[1].isnan().all()


def test_storage_cost():
    assert bytes_per_row(128) == 129  # 128 E4M3 values + one E8M0 scale byte
    x = torch.randn(3, 5, 128)
    v, sb = quantize(x)
    assert v.element_size() * v.numel() + sb.numel() == 3 * 5 * bytes_per_row(128)

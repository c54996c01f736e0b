"""FP4 (E2M1 + E4M3 per-16 scale) reference format: rounding, scales, specials, packing."""


import pytest
import torch

from model.fp4 import BITS_PER_VALUE, E4M3_MAX, E4M3_MIN_SUBNORMAL, block_scales, dequantize, e2m1_decode, e2m1_encode, fake_quantize, quantize


def test_e2m1_grid_round_trips_and_ties_go_to_even():
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.equal(e2m1_decode(e2m1_encode(grid)), grid)
    assert torch.equal(e2m1_decode(e2m1_encode(-grid[1:])), -grid[1:])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    near = torch.tensor([0.26, 0.74, 1.26, 2.49, 2.51, 4.99, 5.01, 7.0])
    assert e2m1_decode(e2m1_encode(near)).tolist() == [0.5, 0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0]
    assert e2m1_encode(torch.tensor([-0.0, -0.1])).tolist() == [0, 0]  # -0 and tiny negatives -> +0


def test_scale_is_rounded_up_so_nothing_saturates():
    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64)[:, None]
    packed, scales = quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 64) and scales.shape == (64, 8)
    s = scales.float()
    amax = x.unflatten(-1, (-1, 16)).abs().amax(-1)
    assert (amax / s <= 6.0).all()  # no value beyond the largest E2M1 magnitude
    # rounded *up*: the next smaller E4M3 value would saturate
    smaller = (scales.view(torch.uint8) - 1).view(torch.float8_e4m3fn).float()
    assert (amax / smaller > 6.0).all()


def test_round_trip_error_is_bounded_by_half_a_step():
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    y = fake_quantize(x)
    s = block_scales(x).float().repeat_interleave(16, -1)
    # E2M1 steps are at most 2 (between 4 and 6), so the error is at most 1 · scale, exactly: the rounding compares |x|
    # with midpoint · scale and decodes to value · scale, products exact in float32, and the float64 difference of two
    # float32 values is exact, so no slack for rounding is needed (nor allowed)
    assert ((y.double() - x.double()).abs() <= s.double()).all()
    # quantise(dequantise(q)) is the identity on the cache: bit-exact re-encode
    p, sc = quantize(x)
    p2, sc2 = quantize(dequantize(p, sc))
    assert torch.equal(p, p2) and torch.equal(sc.view(torch.uint8), sc2.view(torch.uint8))


def test_zeros_subnormals_and_overflow():
    z = torch.zeros(16)
    assert quantize(z)[1].float().item() == E4M3_MIN_SUBNORMAL and torch.equal(fake_quantize(z), z)
    tiny = torch.full((16,), 1e-6)  # scale would be below E4M3's smallest subnormal
    assert block_scales(tiny).float().item() == E4M3_MIN_SUBNORMAL and fake_quantize(tiny).abs().max() == 0
    sub = torch.zeros(16)
    sub[0] = 6 * 2.0**-8  # amax/6 = 2^-8: an E4M3 subnormal scale, held exactly
    assert block_scales(sub).float().item() == 2.0**-8 and fake_quantize(sub)[0] == sub[0]
    big = torch.full((16,), 1e5)
    assert block_scales(big).float().item() == E4M3_MAX and fake_quantize(big)[0] == 6 * E4M3_MAX


def test_inf_saturates_and_nan_poisons_only_its_block():
    x = torch.ones(32)
    x[3] = float("inf")
    x[20] = float("nan")
    y = fake_quantize(x)
    assert y[3] == 6 * E4M3_MAX and torch.isfinite(y[:16]).all()
    assert torch.isnan(y[16:]).all()


def test_packing_layout_and_bits_per_value():
    x = torch.zeros(16)
    x[0], x[1] = 1.0, -6.0  # scale 1: codes 2 (1.0) and 8 + 7 (-6)
    packed, scales = quantize(x)
    assert scales.float().item() == 1.0
    assert packed[0].item() == 2 | (15 << 4)
    assert BITS_PER_VALUE == 4.5
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.zeros(24))

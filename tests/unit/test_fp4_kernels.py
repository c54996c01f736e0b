"""Triton FP4 kernels vs the PyTorch reference: bit-exact (interpreter mode on CPU)."""

import pytest
import torch

from model import fp4 as ref

kernels = pytest.importorskip("model.kernels.fp4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cases():
    torch.manual_seed(0)
    x = torch.randn(6, 128) * torch.logspace(-4, 4, 6)[:, None]
    x[0, :16] = 0.0  # all-zero block
    x[1, 5] = float("inf")
    x[2, 40] = float("nan")
    x[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    x[4] = x[4] * 1e6  # scales that saturate at 448
    return x


@pytest.mark.parametrize("C", [16, 64, 128])
def test_quantize_bit_exact(C):
    x = _cases()[:, :C].to(DEVICE)
    p_ref, s_ref = ref.quantize(x)
    p, s = kernels.quantize(x)
    assert torch.equal(p, p_ref)
    assert torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))


def test_dequantize_bit_exact_and_batched_shapes():
    x = _cases().reshape(2, 3, 128).to(DEVICE)
    p, s = ref.quantize(x)
    y_ref = ref.dequantize(p, s)
    y = kernels.dequantize(p, s)
    assert y.shape == x.shape
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(y_ref, nan=7.0))
    assert torch.equal(y.isnan(), y_ref.isnan())


def test_bad_width_is_refused_and_odd_row_counts_work():
    with pytest.raises(ValueError, match="16"):
        kernels.quantize(torch.zeros(2, 40))
    x = torch.randn(3, 7, 48).to(DEVICE)  # 63 blocks: a partial last program, a width of 3 blocks
    p, s = kernels.quantize(x)
    p_ref, s_ref = ref.quantize(x)
    assert torch.equal(p, p_ref) and torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(kernels.dequantize(p, s, torch.bfloat16), ref.dequantize(p, s, torch.bfloat16))


def test_bf16_input_with_exact_ties_bit_exact():
    """bf16 values land on exact E2M1 midpoints often: ties and divisions must match the reference."""
    torch.manual_seed(2)
    x = (torch.randn(256, 128) * 3).to(torch.bfloat16).to(DEVICE)
    x[:, 0] = 6.0  # scale 1 exactly: every other value is x / 1, many exact ties
    p_ref, s_ref = ref.quantize(x)
    p, s = kernels.quantize(x)
    assert torch.equal(p, p_ref) and torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_midpoint_at_every_scale_bit_exact(dtype):
    """Each E4M3 scale s (amax = 6·s exactly) with ±(midpoint·s) ties, their float neighbours and the
    grid values: the encode's comparisons (>= vs >) and the scale round-up are checked everywhere."""
    s = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2^-9 .. 448
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([torch.tensor([6.0]), mids, -mids[:4], torch.tensor([0.5, -1.5, 4.0, -0.0])])  # 16
    x = (row[None, :] * s[:, None]).to(dtype)
    up, down = x.float().nextafter(torch.tensor(float("inf"))), x.float().nextafter(torch.tensor(0.0))
    x = torch.cat([x, up.to(dtype), down.to(dtype)], 1)  # bf16 rounds the neighbours back: still ties
    nan_block = torch.full((1, 48), 5.0, dtype=dtype)
    nan_block[0, 3] = float("nan")  # codes in a NaN block are 0, whatever the other values
    x = torch.cat([x, nan_block]).to(DEVICE)
    p_ref, s_ref = ref.quantize(x)
    p, sc = kernels.quantize(x)
    assert torch.equal(s_ref[:126, 0].float().cpu(), s)  # the construction hits every scale exactly
    assert torch.equal(p, p_ref) and torch.equal(sc.view(torch.uint8), s_ref.view(torch.uint8))
    assert (p[-1, :8] == 0).all() and sc.view(torch.uint8)[-1].tolist() == [0x7F, 0x36, 0x36]  # 5/6 -> 0.875
    y = kernels.dequantize(p, sc, dtype)
    y_ref = ref.dequantize(p, sc, dtype)
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(y_ref, nan=7.0))


@pytest.mark.skipif(DEVICE != "cuda", reason="the PTX encode runs compiled on CUDA only")
@pytest.mark.parametrize("asm,v2", [(False, False), (True, False), (True, True)])
def test_quantize_encode_paths_bit_exact(asm, v2, monkeypatch):
    """Every E2M1 encode (Triton ops, PTX on bf16 words, the leaner PTX path) against the reference."""
    monkeypatch.setattr(kernels, "QUANT_ASM", asm)
    monkeypatch.setattr(kernels, "QUANT_V2", v2)
    s = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([torch.tensor([6.0]), mids, -mids[:4], torch.tensor([0.5, -1.5, 4.0, -0.0])])
    grid = (row[None, :] * s[:, None]).to(torch.bfloat16)
    torch.manual_seed(3)
    rnd = (torch.randn(512, 128) * torch.logspace(-6, 6, 512)[:, None]).to(torch.bfloat16)
    rnd[0, 3], rnd[1, 7], rnd[2, 100] = float("inf"), float("-inf"), float("nan")
    for x in (grid, rnd, _cases().to(torch.bfloat16)):
        x = x.to(DEVICE)
        p_ref, s_ref = ref.quantize(x)
        p, sc = kernels.quantize(x)
        assert torch.equal(p, p_ref) and torch.equal(sc.view(torch.uint8), s_ref.view(torch.uint8))


@pytest.mark.parametrize("v2", [False, True])
def test_every_bf16_amax_bit_exact(v2, monkeypatch):
    """Every non-negative bf16 magnitude (0 .. max finite, inf) as a block's amax, with random signs and
    smaller values: the scale rule (zeros, subnormals, saturation, inf) and the encode, exhaustively."""
    monkeypatch.setattr(kernels, "QUANT_V2", v2)
    amax = torch.arange(0, 0x7F81, dtype=torch.int16).view(torch.bfloat16).float()  # 32641 magnitudes
    g = torch.Generator().manual_seed(5)
    frac = torch.rand(amax.numel(), 15, generator=g)
    frac[:, :4] = torch.tensor([1.0, 0.5, 0.25, 0.125])
    x = torch.cat([amax[:, None], amax[:, None] * frac], 1)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    x = x.to(torch.bfloat16).to(DEVICE)
    p_ref, s_ref = ref.quantize(x)
    p, sc = kernels.quantize(x)
    assert torch.equal(p, p_ref) and torch.equal(sc.view(torch.uint8), s_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_into_pool_rows_equals_quantize_then_index_copy(dtype):
    """The paged cache's fp4 decode write (model/kernels/fp4.quantize_into): each token's K/V heads encoded
    straight into its slot's row of the pools, bit for bit what quantize + index_copy_ store; other rows untouched."""
    torch.manual_seed(1)
    N, KVH, D, R = 5, 2, 64, 9
    x = (torch.randn(N, KVH, D) * torch.logspace(-3, 3, N)[:, None, None]).to(dtype).to(DEVICE)
    rows = torch.tensor([7, 0, 8, 3, 5], device=DEVICE)  # scattered, first and last rows of the pool included
    packed_pool = torch.randint(0, 255, (R, KVH, D // 2), dtype=torch.uint8, device=DEVICE)
    scale_pool = torch.randint(0, 255, (R, KVH, D // 16), dtype=torch.uint8, device=DEVICE)
    want_p, want_s = packed_pool.clone(), scale_pool.clone()
    p, s = ref.quantize(x)
    want_p.index_copy_(0, rows, p)
    want_s.index_copy_(0, rows, s.view(torch.uint8))
    kernels.quantize_into(x, packed_pool, scale_pool, rows)
    assert torch.equal(packed_pool, want_p) and torch.equal(scale_pool, want_s)
    with pytest.raises(ValueError, match="pools must be"):
        kernels.quantize_into(x, packed_pool[:, :, :8], scale_pool, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_pair_into_reads_strided_rows_and_equals_two_writes(dtype, monkeypatch):
    """The decode step's fp4 write of K and V (quantize_pair_into): one launch, V read in place as a view of the
    fused qkv output (rows strided), bit for bit what two `quantize_into` calls on contiguous copies store."""
    torch.manual_seed(2)
    N, H, KVH, D, R = 5, 4, 2, 64, 9
    qkv = (torch.randn(N, (H + 2 * KVH) * D) * torch.logspace(-3, 3, N)[:, None]).to(dtype).to(DEVICE)
    k = qkv[:, H * D:(H + KVH) * D].reshape(N, KVH, D).clone()  # contiguous, as the RoPE kernel returns it
    v = qkv[:, (H + KVH) * D:].view(N, KVH, D)  # a strided view
    assert not v.is_contiguous()
    rows = torch.tensor([7, 0, 8, 3, 5], device=DEVICE)
    pools = [(torch.randint(0, 255, (R, KVH, D // 2), dtype=torch.uint8, device=DEVICE),
              torch.randint(0, 255, (R, KVH, D // 16), dtype=torch.uint8, device=DEVICE)) for _ in range(2)]
    want = [(p.clone(), s.clone()) for p, s in pools]
    kernels.quantize_into(k, *want[0], rows)
    kernels.quantize_into(v.contiguous(), *want[1], rows)
    monkeypatch.setattr(kernels, "quantize_into", None)  # the one-launch path, not the two-call fallback
    kernels.quantize_pair_into(k, v, pools[0], pools[1], rows)
    for (p, s), (wp, ws) in zip(pools, want):
        assert torch.equal(p, wp) and torch.equal(s, ws)

"""The skinny decode GEMV (model/kernels/gemv.py) against F.linear (issue #15): on CPU interpreted
(TRITON_INTERPRET=1), on CUDA compiled, and there also the per-shape choice of `linear` and a bf16 decode step."""

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1 from tests/conftest.py


@pytest.mark.parametrize("rows,bias", [(1, False), (3, True), (8, False)])
def test_gemv_equals_linear(rows, bias):
    """Widths that are no multiple of the tile (a partial last tile in N and in K), the rows padded to a power of
    two inside the kernel, a bias; bf16 in and out, float32 sums: within one bf16 rounding of F.linear in float32."""
    from model.kernels.gemv import gemv

    g = torch.Generator().manual_seed(rows)
    N, K = 37, 200
    x = torch.randn(1, rows, K, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    got = gemv(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (1, rows, N) and got.dtype == torch.bfloat16
    err = (got.float() - want).abs()
    # one conversion to bf16 (8 significant bits): within 1 ulp (the interpreter truncates, the GPU rounds)
    assert (err <= want.abs() * 2**-7 + 1e-4).all(), err.max()
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(torch.zeros(9, K, dtype=torch.bfloat16, device=DEVICE), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the per-shape timing runs on CUDA")
def test_linear_chooses_per_shape_and_keeps_the_values():
    from model.kernels import gemv

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 1024, generator=g) / 32).to(torch.bfloat16).cuda()
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, 1024, generator=g).to(torch.bfloat16).cuda()
        with torch.no_grad():
            got = gemv.linear(x, w)
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=8e-3)
        key = (rows, 4096, 1024, torch.bfloat16, False)
        assert (key in gemv.decisions) == (rows <= gemv.MAX_M)
    with torch.no_grad():  # float32 is F.linear's, bit for bit (the engine's fp32 tests stay exact)
        x = torch.randn(1, 1024, device="cuda")
        assert torch.equal(gemv.linear(x, w.float()), F.linear(x, w.float()))

"""Fused RMSNorm and RoPE kernels (model/kernels/norm_rope.py) against their PyTorch references; on CPU the
kernels run interpreted (TRITON_INTERPRET=1, tests/conftest.py), on CUDA compiled."""

import pytest
import torch

from model.decoder import rms_norm_eager as rms_norm_ref
from model.decoder import rope_cos_sin
from model.decoder import rope_eager as rope_ref
from model.kernels.norm_rope import rms_norm, rope

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU: interpreted (no GPU, tests/conftest.py)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 1, 4, 16), (7, 576)])
def test_rms_norm_matches_reference(device, dtype, tol, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(device, dtype)
    w = torch.randn(shape[-1], generator=g).to(device, dtype)
    got, want = rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("B, T, H, D", [(2, 3, 4, 16), (5, 1, 9, 64), (1, 7, 2, 128)])
def test_rope_matches_reference(device, dtype, tol, B, T, H, D):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    pos = torch.randint(0, 4000, (B, T), generator=g).to(device)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    got, want = rope(x, cos, sin), rope_ref(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.float() - want.float()).abs().max() <= tol * max(want.float().abs().max().item(), 1.0)


def test_a_wrong_kernel_would_fail_these_tests():
    """The references are not the kernels' mirror: swapping the halves' signs changes the result."""
    x = torch.randn(1, 2, 2, 16, device=DEVICES[0])
    cos, sin = rope_cos_sin(torch.tensor([[3, 9]], device=DEVICES[0]), 16, 10000.0)
    assert (rope_ref(x, cos, -sin) - rope(x, cos, sin)).abs().max() > 1e-2

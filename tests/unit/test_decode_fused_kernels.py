"""The rollout path's fused kernels (model/kernels/decode_fused.py) against their PyTorch references
(model/fused.py: the plain forward's own operations); on CPU the kernels run interpreted (TRITON_INTERPRET=1,
tests/conftest.py), on CUDA compiled."""

import pytest
import torch

from model.decoder import rope_cos_sin
from model.fused import add_rms_norm_eager, qkv_norm_rope_eager, silu_mul_eager
from model.kernels.decode_fused import add_rms_norm, qkv_norm_rope, silu_mul
from model.kv_cache import PagedKVCache

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU: interpreted (no GPU, tests/conftest.py)
TOLS = [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]
"""Relative to the largest reference value; interpreted bf16 gets 3x (see `_rounds_to_nearest`)."""


def _rounds_to_nearest(device: str, dtype: torch.dtype) -> bool:
    """Whether the kernels' casts to `dtype` round as PyTorch's do: compiled on CUDA yes; the interpreter
    (Triton 3.x) truncates float32 -> bfloat16, so interpreted bf16 results agree to one unit in the last place."""
    return device == "cuda" or dtype == torch.float32


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    if got.dtype == torch.bfloat16 and not _rounds_to_nearest(got.device.type, got.dtype):
        tol *= 3  # two truncations in a row (e.g. silu, then the product) are off by up to two units
    return bool((got.float() - want.float()).abs().max() <= tol * max(want.float().abs().max().item(), 1.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", TOLS)
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 1, 576), (7, 100)])
def test_add_rms_norm_matches_reference(device, dtype, tol, shape):
    g = torch.Generator().manual_seed(0)
    x, r = ((torch.randn(shape, generator=g) * 3).to(device, dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(device, dtype)
    (got, got_h), (want, want_h) = add_rms_norm(x, r, w, 1e-6), add_rms_norm_eager(x, r, w, 1e-6)
    assert got.dtype == got_h.dtype == dtype and got.shape == got_h.shape == x.shape
    if _rounds_to_nearest(device, dtype):
        assert torch.equal(got_h, want_h)  # the residual sum is rounded exactly as `h + y`
    assert _close(got_h, want_h, tol)
    assert _close(got, want, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", TOLS)
@pytest.mark.parametrize("shape", [(3, 5, 2 * 128), (1, 1, 2 * 3072), (4, 2 * 24)])
def test_silu_mul_matches_reference(device, dtype, tol, shape):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(shape, generator=g) * 4).to(device, dtype)
    got, want = silu_mul(gate_up), silu_mul_eager(gate_up)
    assert got.dtype == dtype and got.shape == (*shape[:-1], shape[-1] // 2)
    assert _close(got, want, tol)


def _qkv(B, T, H, KVH, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, (H + 2 * KVH) * D, generator=g) * 2).to(device, dtype)
    pos = torch.randint(0, 4000, (B, T), generator=g).to(device)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    qw, kw = (torch.randn(D, generator=g).to(device, dtype) for _ in range(2))
    return qkv, cos, sin, qw, kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", TOLS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("B, T, H, KVH, D", [(2, 3, 4, 2, 16), (5, 1, 16, 8, 128), (1, 4, 6, 6, 24)])
def test_qkv_norm_rope_matches_reference(device, dtype, tol, norm, B, T, H, KVH, D):
    qkv, cos, sin, qw, kw = _qkv(B, T, H, KVH, D, dtype, device, seed=2)
    w = (qw, kw) if norm else (None, None)
    got, want = qkv_norm_rope(qkv, cos, sin, H, KVH, *w, 1e-6), qkv_norm_rope_eager(qkv, cos, sin, H, KVH, *w, 1e-6)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == dtype
        assert _close(a, b, tol)
    assert torch.equal(got[2], want[2])  # v: the GEMM output's view, untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_norm_rope_writes_the_bf16_cache_as_paged_write_does(device, dtype):
    """With a bf16-format cache the kernel puts K (after norm and RoPE) and V into their slots, padding rows
    (slot −1) into the scratch slot, exactly where PagedKVCache.write puts the reference's K and V."""
    B, T, H, KVH, D = 3, 2, 4, 2, 16
    qkv, cos, sin, qw, kw = _qkv(B, T, H, KVH, D, dtype, device, seed=3)
    caches = [PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=KVH, head_dim=D, dtype=dtype,
                           device=device) for _ in range(2)]
    slots = torch.tensor([[5, 6], [0, -1], [13, 2]], device=device)  # one padding token
    k_pool, v_pool, scratch = caches[0].unquantised_layer(1)
    q, k, v = qkv_norm_rope(qkv, cos, sin, H, KVH, qw, kw, 1e-6, cache=(k_pool, v_pool, slots, scratch))
    q_ref, k_ref, v_ref = qkv_norm_rope_eager(qkv, cos, sin, H, KVH, qw, kw, 1e-6)
    caches[1].write(1, slots, k_ref, v_ref)
    real = slots[slots >= 0]
    assert torch.equal(caches[0].k[1][real], k.reshape(-1, KVH, D)[(slots >= 0).reshape(-1)])  # what it returns
    assert _close(caches[0].k[1][real], caches[1].k[1][real], 1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(caches[0].v[1][real], caches[1].v[1][real])
    assert torch.equal(caches[0].v[1][scratch], v[1, 1])  # the padding row went to the scratch slot
    untouched = torch.ones(scratch + 1, dtype=torch.bool, device=device)
    untouched[real], untouched[scratch] = False, False
    assert (caches[0].k[1][untouched] == 0).all() and (caches[0].v[1][untouched] == 0).all()
    assert (caches[0].k[0] == 0).all()  # other layers untouched


def test_a_wrong_kernel_would_fail_these_tests():
    """The references are not the kernels' mirror: up before gate, or a norm without the residual, differ."""
    dev = DEVICES[0]
    gate_up = torch.randn(2, 32, device=dev)
    assert (silu_mul(gate_up) - silu_mul_eager(gate_up.roll(16, dims=-1))).abs().max() > 1e-2
    x, r, w = torch.randn(2, 16, device=dev), torch.randn(2, 16, device=dev), torch.ones(16, device=dev)
    assert (add_rms_norm(x, r, w, 1e-6)[0] - add_rms_norm_eager(x, torch.zeros_like(r), w, 1e-6)[0]).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, pytest.param(128, marks=pytest.mark.slow)])
def test_qkv_norm_rope_writes_the_fp4_cache_as_paged_write_does(device, dtype, D):
    """With an fp4-format cache's (packed, scales) pools the kernel encodes K (after norm and RoPE: the k it
    returns) and V into their slots, padding rows into the scratch slot: byte for byte what PagedKVCache.write
    stores for the same K and V, every other slot and layer untouched. One V row holds a NaN (its block's scale is
    E4M3 NaN, its codes 0) and one K head is all zeros."""
    B, T, H, KVH = 3, 2, 4, 2
    qkv, cos, sin, qw, kw = _qkv(B, T, H, KVH, D, dtype, device, seed=4)
    qkv[0, 1, (H + KVH) * D + 5] = float("nan")  # a V value of a real token (slot 6)
    qkv[2, 0, H * D:(H + 1) * D] = 0.0  # a K head of zeros (before the norm: it stays 0)
    caches = [PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=KVH, head_dim=D, dtype=dtype,
                           device=device, kv_dtype="fp4") for _ in range(2)]
    slots = torch.tensor([[5, 6], [0, -1], [13, 2]], device=device)
    k_pools, v_pools, scratch = caches[0].fp4_layer(1)
    q, k, v = qkv_norm_rope(qkv, cos, sin, H, KVH, qw, kw, 1e-6, cache=(k_pools, v_pools, slots, scratch))
    caches[1].write(1, slots, k, v, read_back=False)
    for name in ("k", "v", "k_scale", "v_scale"):
        got, want = getattr(caches[0], name), getattr(caches[1], name)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    written = torch.zeros(caches[0].k.shape[1], dtype=torch.bool, device=device)
    written[slots[slots >= 0]], written[scratch] = True, True
    assert (caches[0].k[1][written].view(torch.uint8) != 0).any() and (caches[0].k[1][~written] == 0).all()
    assert (caches[0].k_scale[1][6].view(torch.uint8) != 0x7F).all() and (caches[0].v_scale[1][6].view(torch.uint8) == 0x7F).any()
    assert (caches[0].k[0].view(torch.uint8) == 0).all()  # other layers untouched

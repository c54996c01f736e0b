"""Hierarchical indexer pool scoring: Triton kernel vs the PyTorch reference (CPU: interpreter).

float32 runs IEEE dots, so the kernel matches the float64 reference to float32 rounding in any summation
order (tests/numerics.py: DI-term dots, then HI weighted heads, on the scale Σ_h |w_h|·|q_h|·|k|, per score).
bf16 rounds each dot to bf16 as the reference's einsum does; a different float32
accumulation order can move a dot by one bf16 step (2^-8 relative), so atol = 2^-7 · Σ_h |w_h|·|dot_h|.
On random data the top-k picked from either is the same (stable sort, no near ties)."""

import pytest
import torch

from model import sparse_attention as sa
from model.sparse_attention import pool_index_scores, select_topk
from tests.numerics import assert_close_to_reference

kern = pytest.importorskip("model.kernels.indexer")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, T, HI, DI, N, P, dtype, seed=0, n_visible=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HI, DI, generator=g)
    w = torch.randn(B, T, HI, generator=g)
    k = torch.randn(B, N, DI, generator=g)
    pool = torch.randint(0, max(N, 1), (B, T, P), generator=g).sort(-1).values
    ok = torch.rand(B, T, P, generator=g) > 0.2
    if n_visible is not None:  # a causal cut, as build_candidate_pool leaves it
        ok &= pool < n_visible
    pool = torch.where(ok, pool, 0)
    cast = lambda x: x.to(DEVICE, dtype)  # noqa: E731
    return cast(q), cast(w), cast(k), pool.to(DEVICE), ok.to(DEVICE)


CASES = [  # B, T, HI, DI, N, P, block_p
    (2, 1, 4, 16, 37, 48, 16),    # decode shape, HI = 4 padded to 16, three blocks of 16
    (1, 3, 3, 32, 20, 40, 16),    # several queries, HI = 3, P = 40: a partial last block
    (3, 2, 16, 64, 64, 32, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,HI,DI,N,P,block_p", CASES)
def test_pool_scores_match_reference(B, T, HI, DI, N, P, block_p, dtype):
    q, w, k, pool, ok = _case(B, T, HI, DI, N, P, dtype, seed=B * 100 + P)
    out = kern.pool_scores(q, w, k, pool, ok, block_p=block_p)
    ref = kern.pool_scores_ref(q, w, k, pool, ok)
    assert out.dtype == torch.float32 and out.shape == (B, T, P)
    assert torch.equal(torch.isinf(out), ~ok) and torch.equal(torch.isinf(ref), ~ok)
    dots = torch.einsum("bthd,btpd->bthp", q.float(), k[torch.arange(B, device=k.device).view(B, 1, 1), pool].float())
    if dtype == torch.float32:  # against the float64 scores: DI-term dots, then w · relu summed over HI heads
        exact = kern.pool_scores_ref(q.double(), w.double(), k.double(), pool, ok)
        q64, k64 = q.double().abs(), k.double().abs()[torch.arange(B, device=k.device).view(B, 1, 1), pool]
        scale = torch.einsum("bthp,bth->btp", torch.einsum("bthd,btpd->bthp", q64, k64), w.double().abs())
        assert_close_to_reference(out, exact, dtype=torch.float32, reduction=[(DI, 1), (HI, 2)], scale=scale)
    else:  # one bf16 step on each dot, weighted
        atol = 2**-7 * torch.einsum("bthp,bth->btp", dots.abs(), w.float().abs()).max().item()
        assert torch.allclose(out[ok], ref[ok].float(), atol=atol, rtol=0), (out[ok] - ref[ok]).abs().max()
    topk = min(8, P)
    a, r = select_topk(out, topk, pool), select_topk(ref.float(), topk, pool)
    assert torch.equal(a.ids, r.ids) and torch.equal(a.valid, r.valid)


def test_pool_scores_empty_store_and_fully_masked_rows():
    q, w, k, pool, ok = _case(2, 1, 4, 16, 0, 16, torch.float32)
    ok = torch.zeros_like(ok)
    out = kern.pool_scores(q, w, k, pool, ok, block_p=16)
    assert torch.isneginf(out).all()
    q, w, k, pool, ok = _case(2, 2, 4, 16, 10, 16, torch.float32, n_visible=5)
    out = kern.pool_scores(q, w, k, pool, ok)  # default BLOCK_P: one program, mostly masked
    assert torch.allclose(out, kern.pool_scores_ref(q, w, k, pool, ok), atol=1e-4)


def test_pool_index_scores_reference_path_equals_per_query_gather():
    """The layer's non-kernel path (index_select of flattened rows) is bit-identical to the old
    per-query gather + index_scores, and keeps the indexer gradient."""
    q, w, k, pool, ok = _case(2, 3, 2, 8, 11, 8, torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    out = pool_index_scores(q, w, k, pool, ok)
    old = sa.index_scores(q, w, sa._gather_per_query(k, pool)).masked_fill(~ok, float("-inf"))
    assert torch.equal(out, old)
    out[ok].sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="the layer dispatches to the kernel on CUDA only")
def test_layer_selections_with_and_without_kernel_on_cuda(monkeypatch):
    """bf16 decode shapes on the GPU: a Reindex layer's picks with the kernel are a top-k of the
    reference scores up to one bf16 step per dot (summation order), and nearly always the same set."""
    from model.config import ModelConfig, SparseAttentionConfig
    from model.sparse_attention import CSA2Attention, SharedState

    mc = ModelConfig(hidden_size=256, num_heads=4, num_kv_heads=1, head_dim=64)
    cfg = SparseAttentionConfig(compress_ratio=4, topk=64, index_heads=16, index_dim=64, layer_modes=("full", "reindex"),
                                hierarchical=dict(from_layer=0, block_size=8, num_blocks=32))
    torch.manual_seed(0)
    full, reindex = (CSA2Attention(mc, cfg, i).to(DEVICE, torch.bfloat16).eval() for i in (0, 1))
    B, C = 16, 8192
    x = torch.randn(B, 1, 256, device=DEVICE, dtype=torch.bfloat16)
    pos = torch.tensor([C - 1], device=DEVICE)
    shared = SharedState(index_k=torch.randn(B, C // 4, 64, device=DEVICE, dtype=torch.bfloat16))
    seen = []
    real = sa.pool_index_scores
    monkeypatch.setattr(sa, "pool_index_scores", lambda *a: seen.append(a) or real(*a))
    with torch.no_grad():
        full.index(x, shared, pos)
        sel_k, _ = reindex.index(x, shared, pos)
        monkeypatch.setattr(sa, "POOL_KERNEL", False)
        sel_r, _ = reindex.index(x, shared, pos)
    q, w, k, pool, ok = seen[0]
    ref = kern.pool_scores_ref(q, w, k, pool, ok)
    dots = torch.einsum("bthd,btpd->bthp", q.float(), k[torch.arange(B, device=DEVICE).view(B, 1, 1), pool].float())
    tol = 2**-7 * torch.einsum("bthp,bth->btp", dots.abs(), w.float().abs()).amax(-1)  # [B, T]
    ref_of_pick = ref.gather(-1, sel_k.order)  # the kernel's picks, scored by the reference
    kth = ref.topk(cfg.topk, dim=-1).values[..., -1]
    assert bool((ref_of_pick >= (kth - tol)[..., None]).all())
    same = (sel_k.ids.sort(-1).values == sel_r.ids.sort(-1).values).all(-1)
    print(f"identical selections: {int(same.sum())}/{same.numel()} queries")
    assert same.float().mean() >= 0.75

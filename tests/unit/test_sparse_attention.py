"""CSA2 sparse attention (seed §2.3): dense limit, hierarchical == flat when the pool covers everything,
Reuse indices, decode == full forward, causality, indexer-loss gradient isolation."""

import pytest
import torch
from pydantic import ValidationError

from model.config import SparseAttentionConfig
from model.decoder import apply_rope, rope_cos_sin
from model.sparse_attention import (
    CSA2Attention,
    CSA2Cache,
    SharedState,
    build_candidate_pool,
    select_topk,
)
from tests.conftest import debug_config

# float64 where two paths must pick the same top-k: their scores differ only by summation order
# (~1e-16), far below any gap between distinct scores, so selections match and outputs agree to 1e-10.
ATOL64 = 1e-10
ATOL32 = 2e-5  # float32 dense reference vs the sparse path


def _stack(sparse_cfg, num_layers, dtype=torch.float64, seed=0, std=0.3, **model_kw):
    torch.manual_seed(seed)
    mc = debug_config(moe=False, **model_kw)
    layers = torch.nn.ModuleList(CSA2Attention(mc, sparse_cfg, i) for i in range(num_layers)).to(dtype)
    for p in layers.parameters():  # larger than debug init so scores and attention are far from uniform
        torch.nn.init.normal_(p, std=std)
    return layers


def _run(layers, x, cache=None, compute_indexer_loss=False):
    """A toy residual stack: h <- h + attn_l(h). Returns (h, shared)."""
    shared = SharedState(compute_indexer_loss=compute_indexer_loss)
    h = x
    for layer in layers:
        h = h + layer(h, shared, cache)
    return h, shared


def _incremental(layers, x, prefill):
    cache = CSA2Cache()
    outs = [_run(layers, x[:, :prefill], cache)[0]]
    for t in range(prefill, x.shape[1]):
        outs.append(_run(layers, x[:, t : t + 1], cache)[0])
    return torch.cat(outs, 1), cache


def _sorted_valid(sel):
    return torch.where(sel.valid, sel.ids, -1).sort(-1).values


def test_config_rules():
    with pytest.raises(ValidationError, match="start with 'full'"):
        SparseAttentionConfig(layer_modes=("reindex", "full"))
    with pytest.raises(ValidationError, match="smaller than topk"):
        SparseAttentionConfig(topk=64, hierarchical={"block_size": 4, "num_blocks": 8})
    c = SparseAttentionConfig(layer_modes=["full", "reindex", "reuse", "reuse"])
    assert [c.mode_of(i) for i in range(6)] == ["full", "reindex", "reuse", "reuse", "full", "reindex"]


def test_topk_covering_all_entries_is_dense_attention_over_entries_and_window():
    """Independent float32 reference: pool each m-group by hand, rotate with model.decoder's RoPE, attend
    densely over every visible entry plus the window. Checks compression, visibility, window and GQA."""
    m, W, T = 3, 4, 20
    cfg = SparseAttentionConfig(compress_ratio=m, topk=16, window=W, index_heads=2, index_dim=8, layer_modes=("full",))
    layer = _stack(cfg, 1, dtype=torch.float32)[0]
    torch.manual_seed(1)
    x = torch.randn(1, T, 64)
    with torch.no_grad():
        out = layer(x, SharedState())
        H, KVH, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        cos, sin = rope_cos_sin(torch.arange(T)[None], D, layer.rope_theta)
        q = apply_rope(layer.q_proj(x).view(1, T, H, D), cos, sin)[0]
        swa = layer.swa_kv_proj(x).view(1, T, KVH, 2 * D)
        swa_k, swa_v = apply_rope(swa[..., :D], cos, sin)[0], swa[0, ..., D:]
        raw, gate = layer.kv_proj(x).view(T, KVH, 2 * D), layer.compress_gate(x)[0]
        ek, ev = [], []
        for j in range(T // m):
            w = gate[j * m : (j + 1) * m].softmax(0)[..., None]  # [m, KVH, 1]
            e = (raw[j * m : (j + 1) * m] * w).sum(0)
            ek.append(apply_rope(e[None, None, :, :D], cos[:, (j + 1) * m - 1 :], sin[:, (j + 1) * m - 1 :])[0, 0])
            ev.append(e[:, D:])
        ref = torch.zeros(T, H, D)
        for t in range(T):
            n_vis = (t + 1) // m
            ks = torch.stack(ek[:n_vis] + [swa_k[s] for s in range(max(0, t - W + 1), t + 1)])  # [S, KVH, D]
            vs = torch.stack(ev[:n_vis] + [swa_v[s] for s in range(max(0, t - W + 1), t + 1)])
            for h in range(H):
                p = (ks[:, h // (H // KVH)] @ q[t, h] / D**0.5).softmax(0)
                ref[t, h] = p @ vs[:, h // (H // KVH)]
        ref = layer.o_proj(ref.reshape(1, T, H * D))
    assert torch.allclose(out, ref, atol=ATOL32), (out - ref).abs().max()


def test_reindex_rescoring_and_reuse_indices():
    cfg = SparseAttentionConfig(compress_ratio=2, topk=3, window=2, index_heads=2, index_dim=8,
                                layer_modes=("full", "reindex", "reuse", "reuse"))
    layers = _stack(cfg, 4)
    torch.manual_seed(2)
    x = torch.randn(2, 24, 64, dtype=torch.float64)
    with torch.no_grad():
        _, shared = _run(layers, x)
    s = shared.selections
    assert s[2] is s[1] and s[3] is s[1]  # Reuse attends with the latest (Reindex) top-k, untouched
    assert not torch.equal(_sorted_valid(s[0]), _sorted_valid(s[1]))  # Reindex picked its own
    assert shared.source_layer == 0 and sorted(shared.scored) == [0, 1]  # only Full/Reindex score
    # Main KV and indexer K exist once: Reindex/Reuse layers own no main-KV or indexer-K projection.
    assert all(not hasattr(layers[i], "kv_proj") and not hasattr(layers[i], "index_k_proj") for i in (1, 2, 3))
    assert not hasattr(layers[2], "index_q_proj")


def test_candidate_pool_blocks():
    # 10 entries in blocks {0-3}, {4-7}, {8-9}; query 0 sees all, query 1 sees only the first 6.
    s = torch.tensor([[0.0, 1, 0, 0, 0, 0, 5, 0, 2, 0], [0.0, 1, 0, 0, 0, 3, 9, 9, 9, 9]])[None]
    n_vis = torch.tensor([10, 6])
    s = s.masked_fill(torch.arange(10)[None, None] >= n_vis[None, :, None], float("-inf"))
    pool, ok = build_candidate_pool(s, n_vis, block_size=4, num_blocks=2)
    assert pool.shape == (1, 2, 8)
    assert torch.equal(pool[0, 0][ok[0, 0]], torch.tensor([4, 5, 6, 7, 8, 9]))  # blocks 1 (max 5), 2 (max 2)
    assert torch.equal(pool[0, 1][ok[0, 1]], torch.tensor([0, 1, 2, 3, 4, 5]))  # block 2 not visible
    sel = select_topk(torch.tensor([[[1.0, 3, 3, float("-inf")]]]), 3)
    assert sel.ids.tolist() == [[[1, 2, 0]]] and sel.valid.tolist() == [[[True, True, True]]]  # ties: earlier first
    sel = select_topk(torch.tensor([[[1.0, float("-inf")]]]), 3)
    assert sel.valid.tolist() == [[[True, False, False]]]


def _hier_pair(num_blocks, from_layer=0):
    base = dict(compress_ratio=2, topk=4, window=3, index_heads=2, index_dim=8,
                layer_modes=("full", "reindex", "reindex", "reuse", "full", "reindex"))
    flat = _stack(SparseAttentionConfig(**base), 6)
    hier = _stack(SparseAttentionConfig(**base, hierarchical=dict(from_layer=from_layer, block_size=2,
                                                                   num_blocks=num_blocks)), 6)
    hier.load_state_dict(flat.state_dict())
    return flat, hier


def test_pool_covering_every_block_equals_flat_indexer():
    T = 32  # 16 entries = 8 blocks of 2; 8 blocks kept -> the pool is every visible entry
    flat, hier = _hier_pair(num_blocks=8)
    torch.manual_seed(3)
    x = torch.randn(2, T, 64, dtype=torch.float64)
    with torch.no_grad():
        yf, sf = _run(flat, x)
        yh, sh = _run(hier, x)
    for i in range(6):
        assert torch.equal(_sorted_valid(sf.selections[i]), _sorted_valid(sh.selections[i])), i
    assert torch.allclose(yf, yh, atol=ATOL64)
    assert sh.scored[1] == 16  # the pool spans all 16 entries here


def test_small_pool_restricts_reindex_layers_only():
    T = 48  # 24 entries = 12 blocks; keep 3 blocks of 2 -> pool of 6
    flat, hier = _hier_pair(num_blocks=3)
    torch.manual_seed(4)
    x = torch.randn(2, T, 64, dtype=torch.float64)
    with torch.no_grad():
        _, sf = _run(flat, x)
        _, sh = _run(hier, x)
    assert sh.scored == {0: 24, 1: 6, 2: 6, 4: 24, 5: 6}  # Full layers scan everything, Reindex the pool
    assert sf.scored[1] == 24
    pool, ok = sh.candidate_pool
    for i in (1, 2, 5):
        sel = sh.selections[i]
        in_pool = (sel.ids.unsqueeze(-1) == torch.where(ok, pool, -1).unsqueeze(-2)).any(-1)
        assert bool(in_pool[sel.valid].all()), i
    assert not torch.equal(_sorted_valid(sf.selections[1]), _sorted_valid(sh.selections[1]))
    assert torch.equal(_sorted_valid(sf.selections[0]), _sorted_valid(sh.selections[0]))  # Full unaffected
    # from_layer past the first Full layer: the pool comes from layer 4 and only layer 5 is restricted.
    _, late = _hier_pair(num_blocks=3, from_layer=3)
    with torch.no_grad():
        _, sl = _run(late, x)
    assert sl.scored == {0: 24, 1: 24, 2: 24, 4: 24, 5: 6}


@pytest.mark.parametrize("m,hier", [(1, None), (3, None), (2, dict(block_size=2, num_blocks=2))])
def test_decode_step_by_step_equals_full_forward(m, hier):
    cfg = SparseAttentionConfig(compress_ratio=m, topk=3, window=3, index_heads=2, index_dim=8,
                                layer_modes=("full", "reindex", "reuse"), hierarchical=hier)
    layers = _stack(cfg, 5)  # F R U F R: the second Full layer replaces the shared main KV
    T, P = 23, 5
    torch.manual_seed(5)
    x = torch.randn(2, T, 64, dtype=torch.float64)
    with torch.no_grad():
        full, shared = _run(layers, x)
        inc, cache = _incremental(layers, x, prefill=P)
    assert torch.allclose(full, inc, atol=ATOL64), (full - inc).abs().max()
    assert cache.length == T and sorted(cache.layers) == [0, 1, 2, 3, 4]
    # Entries and indexer K live only in the Full layers' caches: T // m entries, T % m pending tokens.
    for i, lc in cache.layers.items():
        if i in (0, 3):
            assert lc.entries_k.shape[1] == lc.index_k.shape[1] == T // m and lc.pending.shape[1] == T % m
        else:
            assert lc.entries_k is None and lc.index_k is None
        assert lc.swa_k.shape[1] == 2  # window - 1 past tokens
    if hier is not None:
        assert shared.scored[1] == 4 < T // m


def test_decode_matches_full_forward_float32():
    cfg = SparseAttentionConfig(compress_ratio=2, topk=4, window=4, index_heads=2, index_dim=8)
    layers = _stack(cfg, 3, dtype=torch.float32, std=0.1)
    torch.manual_seed(6)
    x = torch.randn(1, 17, 64)
    with torch.no_grad():
        full, _ = _run(layers, x)
        inc, _ = _incremental(layers, x, prefill=1)
    assert torch.allclose(full, inc, atol=ATOL32), (full - inc).abs().max()


def test_causality_future_tokens_do_not_change_past_outputs():
    cfg = SparseAttentionConfig(compress_ratio=3, topk=3, window=3, index_heads=2, index_dim=8,
                                layer_modes=("full", "reindex", "reuse"),
                                hierarchical=dict(block_size=2, num_blocks=2))
    layers = _stack(cfg, 3)
    torch.manual_seed(7)
    x = torch.randn(1, 30, 64, dtype=torch.float64)
    t0 = 14  # last token of the group [12, 15): its entry must stay invisible to queries 12 and 13
    x2 = x.clone()
    x2[:, t0:] += torch.randn_like(x2[:, t0:])
    with torch.no_grad():
        y, _ = _run(layers, x)
        y2, _ = _run(layers, x2)
    assert torch.equal(y[:, :t0], y2[:, :t0])
    assert not torch.allclose(y[:, t0:], y2[:, t0:])


def test_indexer_loss_trains_only_the_indexer():
    cfg = SparseAttentionConfig(compress_ratio=2, topk=3, window=2, index_heads=2, index_dim=8,
                                layer_modes=("full", "reindex", "reuse"))
    layers = _stack(cfg, 3)
    torch.manual_seed(8)
    x = torch.randn(2, 20, 64, dtype=torch.float64, requires_grad=True)
    y, shared = _run(layers, x, compute_indexer_loss=True)
    assert sorted(shared.indexer_losses) == [0, 1]
    loss = shared.indexer_loss()
    assert torch.isfinite(loss) and loss > 0
    index_ids = {id(p) for layer in layers for p in layer.indexer_parameters()}
    assert len(index_ids) == 5  # Full: index_{q,w,k}_proj, Reindex: index_{q,w}_proj
    loss.backward(retain_graph=True)
    for name, p in layers.named_parameters():
        if id(p) in index_ids:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or not p.grad.any(), name
    assert x.grad is None or not x.grad.any()
    # And the other way round: the main output gives the indexer no gradient (top-k is discrete).
    for p in layers.parameters():
        p.grad = None
    y.square().sum().backward()
    for name, p in layers.named_parameters():
        assert (id(p) in index_ids) == (p.grad is None or not p.grad.any()), name

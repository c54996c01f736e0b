"""Model core: incremental decode equals full forward, routing replay, checkpoint round trip."""

import torch

from model.checkpoint import save_checkpoint
from model.pretrained import load_checkpoint
from model.decoder import Decoder
from model.kv_cache import PagedBatch, PagedKVCache
from tests.conftest import debug_config

ATOL = 1e-4  # float32, 2-layer model: incremental vs full forward differ only by summation order


def _cache(model, num_blocks=16, block_size=4):
    c = model.config
    return PagedKVCache(num_layers=c.num_layers, num_blocks=num_blocks, block_size=block_size,
                        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)


def _incremental_logits(model, tokens):
    """Prefill the first 3 tokens, then decode the rest one by one through the paged cache."""
    cache = _cache(model)
    blocks = cache.allocate(cache.blocks_for(len(tokens)))
    P = 3
    slots = torch.tensor([cache.slots(blocks, 0, P)])
    out = [model(torch.tensor([tokens[:P]]), batch=PagedBatch(cache, True, slots))[0][0]]
    for pos in range(P, len(tokens)):
        ctx = torch.tensor([cache.slots(blocks, 0, pos + 1)])
        mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
        b = PagedBatch(cache, False, ctx[:, -1:], ctx, mask)
        out.append(model(torch.tensor([[tokens[pos]]]), torch.tensor([[pos]]), batch=b)[0][0])
    return torch.cat(out)


def test_incremental_decode_matches_full_forward(moe_model, dense_model):
    tokens = [1, 20, 31, 5, 9, 44, 17, 3, 60, 2, 11, 12, 13]  # crosses several 4-token blocks
    for model in (moe_model, dense_model):
        with torch.no_grad():
            full, _ = model(torch.tensor([tokens]))
            inc = _incremental_logits(model, tokens)
        assert torch.allclose(full[0], inc, atol=ATOL), (full[0] - inc).abs().max()


def test_padding_does_not_change_real_positions(moe_model):
    a, b = [1, 5, 6, 7, 8, 9], [1, 5, 6]
    with torch.no_grad():
        batched, _ = moe_model(torch.tensor([a, b + [0, 0, 0]]))
        alone, _ = moe_model(torch.tensor([b]))
    assert torch.allclose(batched[1, :3], alone[0], atol=ATOL)


def test_moe_returns_topk_routing_and_replay_reproduces_logits(moe_model):
    x = torch.tensor([[1, 22, 23, 24, 25, 26, 27]])
    with torch.no_grad():
        logits, routing = moe_model(x)
    L, k = moe_model.config.num_layers, moe_model.config.ffn.num_experts_per_tok
    assert routing.shape == (1, 7, L, k)
    assert all(len(set(r.tolist())) == k for r in routing.reshape(-1, k))  # k distinct experts
    # Perturb the router: without replay the choices move; with replay they are forced back.
    with torch.no_grad():
        for layer in moe_model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * 0.5)
        _, routing_free = moe_model(x)
        _, routing_replayed = moe_model(x, routing_replay=routing)
    assert not torch.equal(routing_free, routing)
    assert torch.equal(routing_replayed, routing)


def test_replay_keeps_router_gradient(moe_model):
    x = torch.tensor([[1, 22, 23, 24]])
    with torch.no_grad():
        _, routing = moe_model(x)
    logits, _ = moe_model(x, routing_replay=routing)
    logits.sum().backward()
    g = moe_model.model.layers[0].mlp.gate.weight.grad
    assert g is not None and g.abs().sum() > 0


def test_llama_qwen_parameter_names(moe_model, dense_model):
    names = set(dict(dense_model.named_parameters()))
    for n in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_norm.weight",
              "model.layers.1.mlp.gate_proj.weight", "model.layers.1.post_attention_layernorm.weight", "model.norm.weight",
              "lm_head.weight"]:
        assert n in names
    moe_names = set(dict(moe_model.named_parameters()))
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_proj",
            "model.layers.0.mlp.shared_experts.down_proj.weight"} <= moe_names


def test_checkpoint_round_trip(tmp_path, moe_model):
    path = save_checkpoint(moe_model, tmp_path / "ckpt")
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    loaded = load_checkpoint(path)
    assert loaded.config == moe_model.config
    x = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], moe_model(x)[0])


def test_tied_embeddings_checkpoint(tmp_path):
    torch.manual_seed(1)
    m = Decoder(debug_config(moe=False, tie_word_embeddings=True))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    loaded = load_checkpoint(save_checkpoint(m, tmp_path / "c"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, m.lm_head.weight)


def test_replay_under_activation_checkpointing_gives_the_same_gradient(moe_model):
    x = torch.tensor([[1, 22, 23, 24, 25, 26], [1, 30, 31, 32, 0, 0]])
    with torch.no_grad():
        _, routing = moe_model(x)
        for layer in moe_model.model.layers:  # the router moved since rollout: replay matters
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * 0.5)
    grads = []
    for ckpt in (False, True):
        moe_model.zero_grad()
        moe_model.train()
        logits, used = moe_model(x, routing_replay=routing, checkpoint_layers=ckpt)
        assert torch.equal(used, routing)
        logits.square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in moe_model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)

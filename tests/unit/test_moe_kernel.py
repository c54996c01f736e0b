"""Routed experts without a loop over experts (model/kernels/moe.py, issue #15): the grouped kernels give
`ExpertBank.forward`'s loop (the reference) for every routing shape a step can hold (experts with no pair,
all pairs on two experts, one token, rows beyond one block), in fp32 and bf16, and the alignment puts every
pair exactly once in its expert's blocks. On CPU the kernels run interpreted (TRITON_INTERPRET=1,
tests/conftest.py)."""

import pytest
import torch

from model.decoder import ExpertBank
from model.kernels.moe import align_by_expert, moe_experts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bank(E: int, d: int, f: int, dtype) -> ExpertBank:
    torch.manual_seed(0)
    bank = ExpertBank(E, d, f)
    for p in bank.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5)
    return bank.to(DEV, dtype)


@pytest.mark.parametrize("N, k, E, ids", [
    (5, 2, 8, None),                  # random routing, several experts empty
    (1, 4, 16, None),                 # one token (batch-1 decode)
    (40, 2, 4, None),                 # runs longer than one block
    (9, 2, 6, "one"),                 # all pairs on two experts (long runs, the rest empty)
    (12, 3, 32, None),                # more experts than pairs
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernels_give_the_expert_loop(N, k, E, ids, dtype):
    d, f = 48, 40  # not multiples of the blocks: masked edges
    bank = _bank(E, d, f, dtype)
    g = torch.Generator().manual_seed(N * 100 + E)
    x = torch.randn(N, d, generator=g).to(DEV, dtype)
    if ids == "one":  # slot 0 of every token on expert 3, slot 1 on expert 5: two long runs, the rest empty
        expert_ids = torch.stack([torch.full((N,), 3), torch.full((N,), 5)], 1)[:, :k]
    else:
        expert_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    expert_ids = expert_ids.to(DEV)
    weights = torch.rand(N, k, generator=g).to(DEV)
    with torch.no_grad():
        want = bank.loop(x, expert_ids, weights)
        got = moe_experts(x, expert_ids, weights, bank.gate_proj, bank.up_proj, bank.down_proj)
    assert got.dtype == x.dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * max(scale, 1.0), (got, want)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_alignment_places_every_pair_once_in_its_experts_blocks(block_m):
    g = torch.Generator().manual_seed(block_m)
    N, k, E = 23, 3, 10
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    pairs, block_expert = align_by_expert(ids, E, block_m)
    nk = N * k
    assert pairs.numel() % block_m == 0 and block_expert.numel() == pairs.numel() // block_m
    real = pairs[pairs < nk]
    assert sorted(real.tolist()) == list(range(nk))  # every pair once, the rest padding
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * block_m : (b + 1) * block_m]
        members = block[block < nk]
        if e >= E:  # past the last run: padding only
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (flat[members] == e).all()


def test_an_moe_decoder_outside_autograd_runs_the_grouped_kernels_and_keeps_its_logits(monkeypatch):
    import model.kernels.moe as moe
    from model import fused
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=True)).to(DEV).eval()
    ids = torch.randint(3, 90, (2, 7), device=DEV)
    with torch.no_grad():
        want, want_routing = model(ids)
    calls = []
    grouped = moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    monkeypatch.setattr(fused, "GROUPED_EXPERTS", True)
    with torch.no_grad():
        got, routing = model(ids)
    assert len(calls) == model.config.num_layers  # every MoE layer, none through the loop
    assert torch.equal(routing, want_routing)
    assert (got - want).abs().max().item() <= 1e-4 * max(want.abs().max().item(), 1.0)
    calls.clear()
    model(ids)[0].sum().backward()  # with autograd: the loop, which has a backward
    assert not calls and all(p.grad is not None for p in model.model.layers[0].mlp.experts.parameters())

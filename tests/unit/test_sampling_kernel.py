"""The one-kernel sampler (model/kernels/sampling.py) against its reference, rollout/sampling.py `sample_tokens`
(issue #15): on CPU interpreted (TRITON_INTERPRET=1), on CUDA compiled."""

import pytest
import torch

from rollout import sampling
from rollout.sampling import counter_uniform, sample_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1 from tests/conftest.py


def _draws_agree(logits, temperature, seeds, counters, got, want) -> int:
    """Rows where the kernel's token differs from the reference's must be draws that land within 1e-6 of the
    boundary between the two ids (float32 probabilities summed in another order); returns how many differ."""
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    cdf = torch.log_softmax(logits.float() / t[:, None], -1).exp().double().cumsum(-1)
    target = counter_uniform(seeds, counters) * cdf[:, -1]
    bad = [r for r, (a, b) in enumerate(zip(got, want)) if a != b]
    for r in bad:
        assert temperature[r] > 0, f"greedy row {r}: argmax {want[r]} vs {got[r]}"
        edge = cdf[r, min(got[r], want[r])]
        assert abs(edge - target[r]) < 1e-6, f"row {r}: draw {target[r]:.9f} is not at the boundary {edge:.9f}"
    return len(bad)


@pytest.mark.parametrize("dtype,blocks_per_split", [(torch.float32, 8), pytest.param(torch.bfloat16, 1, marks=pytest.mark.slow)])
def test_kernel_draws_the_reference_tokens_and_logprobs(dtype, blocks_per_split, monkeypatch):
    """One split per row (the default at this vocabulary), and three: each split's max, sum and argmax combined."""
    from model.kernels import sampling as kernel
    from model.kernels.sampling import sample_top_p1

    monkeypatch.setattr(kernel, "BLOCKS_PER_SPLIT", blocks_per_split)
    device = DEVICE
    g = torch.Generator().manual_seed(0)
    B, V = 48, 3000  # V not a multiple of the 1,024-id block: the last block is partial
    logits = (torch.randn(B, V, generator=g) * 4)
    logits[::7, 11] = 40.0  # peaked rows: the draw lands in the first block
    logits[1::7, V - 5] = 40.0  # ... in the last, partial one
    logits[4, 2100] = logits[4, 50] = 50.0  # a greedy tie across blocks (row 4: temperature 0): the first id wins, as torch.argmax
    logits = logits.to(dtype).to(device)
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.7] * (B // 4), device=device)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (B,), generator=g).to(device)  # negative seeds too: the hash masks them
    counters = torch.randint(0, 2 ** 40, (B,), generator=g).to(device)
    got, got_lp = sample_top_p1(logits, temperature, seeds, counters)
    sampling.SAMPLE_KERNEL = False
    try:
        want, want_lp = sample_tokens(logits.float(), temperature, torch.ones(B, device=device), seeds, counters,
                                      nucleus=False)
    finally:
        sampling.SAMPLE_KERNEL = True
    assert got.dtype == torch.int64 and got_lp.dtype == torch.float32
    assert got[4] == 50 and (got[::7] == 11).all()
    assert _draws_agree(logits.cpu(), temperature.cpu(), seeds.cpu(), counters.cpu(), got.tolist(), want.tolist()) <= 1
    same = got == want
    assert (got_lp[same] - want_lp[same]).abs().max() < 1e-5


@pytest.mark.slow
def test_kernel_draws_follow_the_counter_stream():
    """A flat distribution over V ids puts the draw at floor(u · V): the kernel's hash is counter_uniform's; half
    the rows draw within 1e-3 of the boundary between the two 1,024-id blocks, where the block search decides."""
    from model.kernels.sampling import sample_top_p1

    B, V = 64, 2048
    cands = torch.arange(200_000, dtype=torch.int64) * 7919 - 30
    near = cands[(counter_uniform(cands, torch.zeros_like(cands)) - 0.5).abs() < 1e-3][: B // 2]
    seeds = torch.cat([cands[: B - len(near)], near])
    counters = torch.zeros(B, dtype=torch.int64)
    got, lp = sample_top_p1(torch.zeros(B, V, device=DEVICE), torch.ones(B, device=DEVICE), seeds.to(DEVICE),
                            counters.to(DEVICE))
    got, lp = got.cpu(), lp.cpu()
    u = counter_uniform(seeds, counters)
    assert got.tolist() == (u * V).floor().long().tolist()
    assert torch.allclose(lp, torch.full((B,), -torch.log(torch.tensor(float(V)))), atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine uses the kernel on CUDA")
def test_sample_tokens_takes_the_kernel_for_top_p1_rows_and_the_sort_for_the_others():
    B, V = 16, 5000
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(B, V, generator=g) * 3).cuda()
    temperature = torch.ones(B, device="cuda")
    top_p = torch.tensor([1.0, 0.9] * (B // 2), device="cuda")
    seeds, counters = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
    mixed = sample_tokens(logits, temperature, top_p, seeds, counters)
    alone = sample_tokens(logits, temperature, torch.ones(B, device="cuda"), seeds, counters, nucleus=False)
    assert (mixed[0][::2] == alone[0][::2]).all() and (mixed[1][::2] == alone[1][::2]).all()
    sampling.SAMPLE_KERNEL = False
    try:
        eager = sample_tokens(logits, temperature, top_p, seeds, counters)
    finally:
        sampling.SAMPLE_KERNEL = True
    assert (mixed[0][1::2] == eager[0][1::2]).all()  # nucleus rows: the sort, as before

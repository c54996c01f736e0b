"""The rollout sampler at top_p = 1 in one kernel (issue #15): one program per row reads the row's logits (any
float dtype) and returns its token and the token's logprob, where the eager sampler (the reference:
rollout/sampling.py `sample_tokens` with `nucleus=False`) launches ~40 kernels over float32 copies of the
[B, V] logits (at batch 64 of a 151,936-id vocabulary ~0.35 ms of an H200's ~2.3 ms decode step; at batch 1 its
one-block softmax alone took 34 us).

Per row, with t = temperature (1 for greedy rows, t <= 0), x = float32(logits) / t:
    pass 1   m = max x, s = sum exp(x - m) (online over 1,024-id blocks), lse = m + log s; the first argmax
    pass 2   p = exp(x - lse) in float32 (the reference's `log_softmax(..).exp()`); total = sum over blocks of
             float64 block sums (the reference's `inverse_cdf` sums the same 1,024-id blocks in float64)
    pass 3   target = u · total, u = the counter hash of (seed, counter) (`counter_uniform`, in uint32 here:
             its multiplies are modulo 2^32); the first block whose float64 running sum reaches the target,
             inside it the first id whose float64 running sum does
    token = argmax for greedy rows, else the drawn id; logprob = x[token] - lse.
The reductions run in another order than torch's, so probabilities differ from the reference's in the last
float32 bits: a draw that lands within ~1e-6 of a boundary between two ids can pick the neighbour (the parity
test bounds how close); logprobs agree to ~1e-6. The engine uses this kernel on CUDA for every top_p = 1 row,
inside the decode graphs and after them, so that its own paths agree exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Ids per block: the reference's `inverse_cdf` block, so that both locate the draw block by block."""


@triton.jit
def _mix32(x):
    """rollout/sampling.py `_mix32` on uint32: x * c & 0xFFFFFFFF is the uint32 product."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    x = x * 0x297A2D39
    return x ^ (x >> 15)


@triton.jit
def _sample_kernel(logits_ptr, stride, temp_ptr, seed_ptr, counter_ptr, tok_ptr, logp_ptr, V,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    cols = tl.arange(0, BLOCK_V)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + cols
        raw = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        x = raw / t
        bm = tl.max(x, axis=0)
        m_new = tl.maximum(m, bm)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        rm = tl.max(raw, axis=0)  # the argmax of the raw logits, first id on ties (torch.argmax)
        rid = tl.min(tl.where(raw == rm, ids, V), axis=0).to(tl.int64)
        take = rm > best
        best_id = tl.where(take, rid, best_id)
        best = tl.where(take, rm, best)
    lse = m + tl.log(s)

    total = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK_V):
        ids = start + cols
        x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) / t
        total += tl.sum(tl.exp(x - lse).to(tl.float64), axis=0)

    seed = tl.load(seed_ptr + row)
    counter = tl.load(counter_ptr + row)
    h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    u = ((h >> 8).to(tl.float64) + 0.5) / 16777216.0
    target = u * total

    cum = tl.zeros((), tl.float64)
    drawn = tl.full((), -1, tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + cols
        x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) / t
        p = tl.exp(x - lse).to(tl.float64)
        block_sum = tl.sum(p, axis=0)
        # this block holds the draw: the first whose running sum reaches it (the last one's running sum is `total`,
        # summed in this order in pass 2, and target < total)
        here = (drawn < 0) & (cum + block_sum >= target)
        inner = tl.cumsum(p, axis=0) + cum
        k = tl.min(tl.where(inner >= target, cols, BLOCK_V - 1), axis=0).to(tl.int64)
        drawn = tl.where(here, tl.minimum(start + k, V - 1), drawn)
        cum += block_sum
    token = tl.where(greedy, best_id, drawn)
    x_tok = tl.load(base + token).to(tl.float32) / t
    tl.store(tok_ptr + row, token)
    tl.store(logp_ptr + row, x_tok - lse)


def sample_top_p1(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, rows contiguous), temperature float [B], seeds, counters int64 [B] ->
    (tokens [B] int64, logprobs [B] float32): `rollout.sampling.sample_tokens(..., nucleus=False)` in one kernel."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _sample_kernel[(B,)](logits, logits.stride(0), temperature.contiguous(), seeds.contiguous(),
                             counters.contiguous(), tokens, logprobs, V, BLOCK_V=BLOCK, num_warps=8)
    return tokens, logprobs

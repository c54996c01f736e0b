"""The rollout sampler at top_p = 1 in three kernels (issue #15), where the eager sampler (the reference:
rollout/sampling.py `sample_tokens` with `nucleus=False`) launches ~40 over float32 copies of the [B, V] logits (at
batch 64 of a 151,936-id vocabulary ~0.35 ms of an H200's ~2.3 ms decode step; at batch 1 its one-block softmax
alone took 34 us). The logits are read in their own dtype.

Per row, with t = temperature (1 for greedy rows, t <= 0), x = float32(logits) / t, the row split into programs of
8 blocks of 1,024 ids (the reference's `inverse_cdf` block):
    pass 1   per split: max x, sum exp(x - max) (online over its blocks), the raw logits' first argmax
    pass 2   per split: lse from every split's (max, sum); p = exp(x - lse) in float32 (the reference's
             `log_softmax(..).exp()`), summed per block in float64
    pass 3   per row: u = the counter hash of (seed, counter) (`counter_uniform`, in uint32 here: its multiplies
             are modulo 2^32); target = u · total; the first block whose float64 running sum reaches the
             target, inside it the first id whose float64 running sum does
    token = the argmax for greedy rows, else the drawn id; logprob = x[token] - lse.
The reductions run in another order than torch's, so probabilities differ from the reference's in the last
float32 bits: a draw that lands within ~1e-6 of a boundary between two ids can pick the neighbour (the parity
test bounds how close); logprobs agree to ~1e-6. The engine uses these kernels on CUDA for every top_p = 1 row,
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
def _split_max_kernel(logits_ptr, stride, temp_ptr, m_ptr, s_ptr, best_ptr, best_id_ptr, V, S,
                      BLOCK_V: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr):
    """Pass 1 over one split of a row: the online max and exp-sum of x, and the raw logits' first argmax."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = logits_ptr + row * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    t = tl.where(t <= 0.0, 1.0, t)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.zeros((), tl.int64)
    for b in range(BLOCKS_PER_SPLIT):
        ids = (split * BLOCKS_PER_SPLIT + b) * BLOCK_V + cols
        raw = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        x = raw / t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)  # m finite: a split's first block is inside V
        m = m_new
        rm = tl.max(raw, axis=0)  # first id on ties, as torch.argmax
        rid = tl.min(tl.where(raw == rm, ids, V), axis=0).to(tl.int64)
        take = rm > best
        best_id = tl.where(take, rid, best_id)
        best = tl.where(take, rm, best)
    tl.store(m_ptr + row * S + split, m)
    tl.store(s_ptr + row * S + split, s)
    tl.store(best_ptr + row * S + split, best)
    tl.store(best_id_ptr + row * S + split, best_id)


@triton.jit
def _row_lse(m_ptr, s_ptr, row, S, S_P2: tl.constexpr):
    """log-sum-exp of a row's x from its splits' (max, exp-sum)."""
    k = tl.arange(0, S_P2)
    m = tl.load(m_ptr + row * S + k, mask=k < S, other=float("-inf"))
    s = tl.load(s_ptr + row * S + k, mask=k < S, other=0.0)
    mm = tl.max(m, axis=0)
    return mm + tl.log(tl.sum(s * tl.exp(m - mm), axis=0))


@triton.jit
def _block_sums_kernel(logits_ptr, stride, temp_ptr, m_ptr, s_ptr, sums_ptr, V, S, NB,
                       BLOCK_V: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, S_P2: tl.constexpr):
    """Pass 2 over one split: p = exp(x - lse) in float32, summed per 1,024-id block in float64."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = logits_ptr + row * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    t = tl.where(t <= 0.0, 1.0, t)
    lse = _row_lse(m_ptr, s_ptr, row, S, S_P2)
    cols = tl.arange(0, BLOCK_V)
    for b in range(BLOCKS_PER_SPLIT):
        blk = split * BLOCKS_PER_SPLIT + b
        ids = blk * BLOCK_V + cols
        x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) / t
        tl.store(sums_ptr + row * NB + blk, tl.sum(tl.exp(x - lse).to(tl.float64), axis=0), mask=blk < NB)


@triton.jit
def _draw_kernel(logits_ptr, stride, temp_ptr, seed_ptr, counter_ptr, m_ptr, s_ptr, best_ptr, best_id_ptr, sums_ptr,
                 tok_ptr, logp_ptr, V, S, NB, BLOCK_V: tl.constexpr, S_P2: tl.constexpr, NB_P2: tl.constexpr):
    """Pass 3, one program per row: the block whose float64 running sum first reaches u · total, then the id inside it."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    lse = _row_lse(m_ptr, s_ptr, row, S, S_P2)

    k = tl.arange(0, S_P2)
    best = tl.load(best_ptr + row * S + k, mask=k < S, other=float("-inf"))
    best_ids = tl.load(best_id_ptr + row * S + k, mask=k < S, other=V)
    best_id = tl.min(tl.where(best == tl.max(best, axis=0), best_ids, V), axis=0).to(tl.int64)

    seed = tl.load(seed_ptr + row)
    counter = tl.load(counter_ptr + row)
    h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    u = ((h >> 8).to(tl.float64) + 0.5) / 16777216.0

    nb = tl.arange(0, NB_P2)
    cum_blocks = tl.cumsum(tl.load(sums_ptr + row * NB + nb, mask=nb < NB, other=0.0), axis=0)
    total = tl.max(tl.where(nb == NB - 1, cum_blocks, 0.0), axis=0)
    target = u * total  # < total: the last block's running sum reaches it
    j = tl.min(tl.where(cum_blocks >= target, nb, NB - 1), axis=0)
    before = tl.max(tl.where(nb == j - 1, cum_blocks, 0.0), axis=0)
    cols = tl.arange(0, BLOCK_V)
    ids = j * BLOCK_V + cols
    x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) / t
    inner = tl.cumsum(tl.exp(x - lse).to(tl.float64), axis=0) + before
    kk = tl.min(tl.where(inner >= target, cols, BLOCK_V - 1), axis=0)
    drawn = tl.minimum(j * BLOCK_V + kk, V - 1).to(tl.int64)

    token = tl.where(greedy, best_id, drawn)
    x_tok = tl.load(base + token).to(tl.float32) / t
    tl.store(tok_ptr + row, token)
    tl.store(logp_ptr + row, x_tok - lse)


BLOCKS_PER_SPLIT = 8
"""1,024-id blocks per program of passes 1 and 2: a 151,936-id row spreads over 19 programs."""


def sample_top_p1(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, rows contiguous), temperature float [B], seeds, counters int64 [B] ->
    (tokens [B] int64, logprobs [B] float32): `rollout.sampling.sample_tokens(..., nucleus=False)` in three
    kernels (two over [B, splits] programs, one per row)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if not B:
        return tokens, logprobs
    NB = triton.cdiv(V, BLOCK)
    S = triton.cdiv(NB, BLOCKS_PER_SPLIT)
    m, s, best = (torch.empty(B, S, dtype=torch.float32, device=dev) for _ in range(3))
    best_id = torch.empty(B, S, dtype=torch.int64, device=dev)
    sums = torch.empty(B, NB, dtype=torch.float64, device=dev)
    temperature, seeds, counters = temperature.contiguous(), seeds.contiguous(), counters.contiguous()
    S_P2, stride = triton.next_power_of_2(S), logits.stride(0)
    _split_max_kernel[(B, S)](logits, stride, temperature, m, s, best, best_id, V, S, BLOCK_V=BLOCK,
                              BLOCKS_PER_SPLIT=BLOCKS_PER_SPLIT, num_warps=4)
    _block_sums_kernel[(B, S)](logits, stride, temperature, m, s, sums, V, S, NB, BLOCK_V=BLOCK,
                               BLOCKS_PER_SPLIT=BLOCKS_PER_SPLIT, S_P2=S_P2, num_warps=4)
    _draw_kernel[(B,)](logits, stride, temperature, seeds, counters, m, s, best, best_id, sums, tokens, logprobs,
                       V, S, NB, BLOCK_V=BLOCK, S_P2=S_P2, NB_P2=triton.next_power_of_2(NB), num_warps=4)
    return tokens, logprobs

"""Token sampling with a counter-based RNG: the uniform draw for token i of a sample is a hash of
(sample seed, i). A sample's random stream therefore does not depend on which other samples share
its batch, on when it joined, or on interruptions: batched, one-at-a-time and interrupted-then-resumed
generation draw the same numbers, and a `RolloutState` needs no RNG blob.

All ops are vectorised over the batch with no host synchronisation. On CUDA the rows at top_p = 1 are drawn by
one Triton kernel (model/kernels/sampling.py) that computes what `sample_tokens` below does, which stays the
reference and the CPU path.
"""

from __future__ import annotations

import os

import torch

SAMPLE_KERNEL = os.environ.get("ASYNCRL_SAMPLE_KERNEL", "1") == "1"
"""On CUDA, top_p = 1 rows are sampled by model/kernels/sampling.py (three kernels instead of ~40 over float32
copies of the logits); `ASYNCRL_SAMPLE_KERNEL=0` (or False here, as benches do) keeps the eager ops."""

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Integer hash on values in [0, 2^32) held in int64; multipliers < 2^31 so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """seeds, counters int64 [B] -> uniforms in (0, 1), float64 [B]."""
    h = _mix32(seeds & _M32)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    h = _mix32(h ^ (counters & _M32))
    return ((h >> 8).double() + 0.5) / float(1 << 24)


_BLOCK = 1024
"""Vocabulary ids per block of the two-level inverse CDF."""


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (unnormalised is fine), u [B] in (0, 1) -> the id t with C(t-1) <= u·C(V) < C(t), C the
    cumulative sum in id order. Two levels so that no float64 scan runs over the whole vocabulary (a
    151,936-id scan of a 64-row batch cost 0.29 ms on an H200): float64 sums of 1,024-id blocks, a scan
    over the blocks to find the block, then a scan inside that one block only."""
    B, V = probs.shape
    nb = -(-V // _BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, nb * _BLOCK - V)).view(B, nb, _BLOCK)
    cum_blocks = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb]
    target = u * cum_blocks[:, -1]
    j = torch.searchsorted(cum_blocks, target[:, None]).clamp_max(nb - 1)  # [B, 1] the block holding the draw
    before = torch.where(j > 0, cum_blocks.gather(1, (j - 1).clamp_min(0)), torch.zeros_like(target[:, None]))
    inner = blocks.gather(1, j[:, :, None].expand(B, 1, _BLOCK))[:, 0].double().cumsum(-1) + before  # [B, BLOCK]
    k = torch.searchsorted(inner, target[:, None]).clamp_max(_BLOCK - 1)
    return (j * _BLOCK + k).squeeze(-1).clamp_max(V - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    nucleus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 (or the head's dtype: read as float32); temperature, top_p float [B]; seeds, counters
    int64 [B].

    Returns (tokens [B] int64, logprobs [B] float32). The logprob is log softmax(logits / T) at the
    chosen token (T = 1 for greedy rows): the behaviour policy before top-p truncation, which is what
    the trainer recomputes. Greedy rows (T == 0) take the argmax.

    A row with top_p = 1 draws by inverse CDF over the vocabulary in id order (`inverse_cdf`): no sort. A row with
    top_p < 1 sorts its probabilities and draws within the nucleus. Each row's token depends only on its
    own logits, settings and (seed, counter), never on its batch mates. `nucleus=False` (the caller
    knows on the host that every row has top_p = 1: no sync) skips the sort for the whole batch.
    """
    fast = None
    if SAMPLE_KERNEL and logits.is_cuda:
        from model.kernels.sampling import sample_top_p1

        fast = sample_top_p1(logits, temperature, seeds, counters)
        if not nucleus:
            return fast
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    probs = logp.exp()
    u = counter_uniform(seeds, counters)
    V = logits.shape[-1]
    sampled = inverse_cdf(probs, u)
    if nucleus:
        probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
        cum_sorted = probs_sorted.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        keep = (cum_sorted - probs_sorted) < top_p[:, None]
        cum_sorted = (probs_sorted * keep).double().cumsum(-1)
        pick = torch.searchsorted(cum_sorted, (u * cum_sorted[:, -1])[:, None]).clamp_max(V - 1)
        sampled = torch.where(top_p < 1, order.gather(-1, pick).squeeze(-1), sampled)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    logprobs = logp.gather(-1, tokens[:, None]).squeeze(-1)
    if fast is not None:  # the kernel's draws for the top_p = 1 rows, as steps without a nucleus row take them
        full = top_p >= 1
        tokens, logprobs = torch.where(full, fast[0], tokens), torch.where(full, fast[1], logprobs)
    return tokens, logprobs

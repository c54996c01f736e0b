"""Skinny linear layers of small-batch decode (issue #15): y = x·Wᵀ (+ b) for a few rows x [M, K] (M <= 8).

At batch 1 an H200 decode step of the Qwen3-0.6B shape spent 0.71 ms of its 1.28 ms of kernel time in cuBLAS's
GEMV kernels, 5-8 us each where reading their weights takes 1-3 us (BENCHMARKS.md, "Rollout engine"). Here a
program owns BLOCK_N output columns of one row of x and reads their [BLOCK_N, K] slice of W in BLOCK_K-wide
tiles (contiguous along K: 16-byte loads), the loop over K unrolled so that all its loads are in flight at once,
products accumulated elementwise in float32 and reduced over K at the end: one rounding to the output dtype, as
cuBLAS does, the sum in another order (outputs can differ from F.linear's in the last bit of bf16). Rows of x
are programs of their own (the grid's second axis): at M > 1 they read the same tiles, mostly from L2.

`linear` is what the rollout path calls: for a CUDA half-precision input of at most MAX_M rows, outside autograd,
it times each tile of CONFIGS and F.linear once per shape, as device time inside a CUDA graph (outside any
capture), and keeps the fastest; everything else, and float32 (whose engine tests are bit-exact), is F.linear.
`ASYNCRL_GEMV_KERNEL=0` (or GEMV_KERNEL = False) keeps F.linear everywhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

GEMV_KERNEL = os.environ.get("ASYNCRL_GEMV_KERNEL", "1") == "1"
MAX_M = 8
"""Most rows the kernel takes: its tile holds every row of x (beyond a few, cuBLAS's GEMM kernels win)."""

decisions: dict[tuple, tuple] = {}
"""(M, N, K, dtype, bias) -> (kernel chosen, kernel us, F.linear us, tile): what `linear` measured, device time in
graph replay (benches print it)."""


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row m = program_id(1) of y, columns [pid·BLOCK_N, +BLOCK_N). K is a constant: the loop over it unrolls, so
    every tile's load is issued before the first product (many bytes in flight per program); products accumulate
    elementwise in a [BLOCK_N, BLOCK_K] float32 tile, reduced over K once at the end."""
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(x_ptr + m * stride_xm + kk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


CONFIGS = ((1, 1024, 4), (1, 512, 2), (2, 512, 2), (2, 1024, 4), (4, 256, 2), (4, 512, 4), (4, 1024, 4), (8, 256, 4),
           (8, 512, 4), (16, 256, 4), (2, 256, 1), (4, 256, 1))
"""Tiles tried per shape (BLOCK_N, BLOCK_K, num_warps); `bench/gemv.py` times a wider set."""
DEFAULT = (4, 256, 2)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most MAX_M rows, weight [N, K] (rows contiguous); `config`
    (BLOCK_N, BLOCK_K, num_warps): the tile, else the one `linear` chose for this shape, else DEFAULT."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > MAX_M or weight.stride(-1) != 1 or weight.shape[1] != K:
        raise ValueError(f"gemv: x {tuple(x.shape)} (at most {MAX_M} rows) and weight {tuple(weight.shape)} "
                         "(contiguous rows of the same width)")
    if config is None:
        chosen = decisions.get(_key(M, weight, bias))
        config = chosen[3] if chosen is not None else DEFAULT
    if _INTERPRETED:
        config = (4, 64, 1)  # small tiles: the interpreter's time grows with the tile
    bn, bk, warps = config
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn), M)](x2, weight, bias if bias is not None else weight, y, N, x2.stride(0),
                                           weight.stride(0), y.stride(0), K=K, HAS_BIAS=bias is not None, BLOCK_N=bn,
                                           BLOCK_K=bk, num_warps=warps)
    return y.reshape(*x.shape[:-1], N)


def _key(M: int, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return (M, weight.shape[0], weight.shape[1], weight.dtype, bias is not None)


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Device time of one `fn()` replayed inside a CUDA graph (as decode steps run it: no launch overhead), in us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def _faster(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """(kernel faster, its us, F.linear's us, its tile): each tile of CONFIGS and F.linear timed in graph replay."""
    theirs = graph_us(lambda: F.linear(x, weight, bias))
    timed = [(graph_us(lambda c=c: gemv(x, weight, bias, c)), c) for c in CONFIGS]
    ours, config = min(timed)
    return ours < theirs, ours, theirs, config


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv` where that was measured faster for this shape (module docstring)."""
    if not (GEMV_KERNEL and x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and not torch.is_grad_enabled() and weight.stride(-1) == 1):
        return F.linear(x, weight, bias)
    M = x.numel() // x.shape[-1]
    if M > MAX_M or M == 0:
        return F.linear(x, weight, bias)
    key = _key(M, weight, bias)
    choice = decisions.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():  # cannot time inside a capture: the safe choice
            return F.linear(x, weight, bias)
        choice = decisions[key] = _faster(x, weight, bias)
    return gemv(x, weight, bias) if choice[0] else F.linear(x, weight, bias)

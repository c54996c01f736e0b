"""Packed sequences: several token rows concatenated into one, attended with a document mask (issue #41).

A packed micro-batch holds its n rows back to back in one row of N = Σ L_i tokens, with no padding:

    tokens     [x^1_0 .. x^1_{L_1-1} | x^2_0 .. x^2_{L_2-1} | ...]        cu_seqlens = [0, L_1, L_1+L_2, ..., N]
    positions  [0 .. L_1-1           | 0 .. L_2-1           | ...]        (RoPE restarts in every row)

and attention is causal within a row and blind across rows (a block-diagonal causal mask), so every row computes
exactly what it computes alone. The projections, the FFN (dense or MoE, routing replay included) and the norms are
per token and do not care where a row starts; only attention needs `PackedSequences`.

Two implementations of the masked attention, one contract (`varlen_attention`):
- CUDA, bf16/fp16: FlashAttention-2's variable-length kernel through PyTorch (`torch.nn.attention.varlen`), which
  takes the cumulative lengths directly: no mask is built, no padded token is computed, and nothing is compiled or
  planned per shape (a new batch of lengths every step costs nothing; cuDNN's graphs did: rl/train/trainer.py
  `SEQ_BUCKET_CUDNN`). FlexAttention would serve too, but needs torch.compile and a block mask rebuilt for every new
  set of lengths; the varlen kernel is the one verl and prime-rl train with (flash_attn_varlen_func).
- Elsewhere (CPU, float32): PyTorch's SDPA over each row's slice in turn, causal: the same block-diagonal mask
  without materialising it (Σ L_i² work, not N²). CI's packed-against-padded tests run this path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedSequences:
    """Where each row of a packed forward begins: `cu_seqlens` [n + 1] int32 on the tokens' device, and the same
    offsets and the longest row on the host (the kernels take max_len as an int; the CPU path slices)."""

    cu_seqlens: torch.Tensor
    offsets: tuple[int, ...]
    max_len: int

    @classmethod
    def from_lengths(cls, lengths: list[int] | tuple[int, ...], device: torch.device | str) -> "PackedSequences":
        offsets = [0]
        for n in lengths:
            if n <= 0:
                raise ValueError(f"a packed row needs at least one token, got lengths {list(lengths)}")
            offsets.append(offsets[-1] + n)
        return cls(torch.tensor(offsets, dtype=torch.int32, device=device), tuple(offsets), max(lengths))

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[1, N] int64: 0..L_i-1 within every row (RoPE restarts at each row)."""
        return torch.cat([torch.arange(b - a, device=device) for a, b in zip(self.offsets, self.offsets[1:])])[None]


def _find_flash_varlen():
    """(varlen_attn, how it is told causal, whether it takes GQA) for this PyTorch, or None without it. The
    keyword changed between releases: `is_causal=True` (2.10-2.11) or `window_size=(-1, 0)` (later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


_FLASH_VARLEN: tuple | None | bool = False
"""`_find_flash_varlen()`'s answer once looked up (False: not yet). Not at import: torch.nn.attention.varlen imports
torch._dynamo."""


def _flash_varlen():
    """`_find_flash_varlen()`, looked up once (`prepare_for_compile` looks it up before a layer is compiled: the
    compiled layer then reads a constant)."""
    global _FLASH_VARLEN
    if _FLASH_VARLEN is False:
        _FLASH_VARLEN = _find_flash_varlen()
    return _FLASH_VARLEN


def flash_varlen_ok(q: torch.Tensor) -> bool:
    """Whether `varlen_attention` takes the FlashAttention kernel for `q` (CUDA, half precision, head_dim ≤ 256)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and _flash_varlen() is not None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """Causal attention within each packed row. q [1, N, H, D], k, v [1, N, KVH, D] (after RoPE; KVH divides H)
    -> [1, N, H, D]."""
    gqa = q.shape[2] != k.shape[2]
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        # autocast casts SDPA's inputs to its dtype but knows nothing of the varlen op: RoPE's float32 cos/sin have
        # promoted q and k to float32 here, which FlashAttention does not take
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if flash_varlen_ok(q):
        varlen_attn, causal, takes_gqa = _flash_varlen()
        if gqa and not takes_gqa:
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        extra = {"enable_gqa": True} if gqa and takes_gqa else {}
        cu = packed.cu_seqlens
        out = varlen_attn(q[0], k[0], v[0], cu, cu, packed.max_len, packed.max_len, **causal, **extra)
        return out[None]
    return _ATTEND_ROWS(q, k, v, packed.offsets, gqa)


def prepare_for_compile() -> None:
    """Before a layer is compiled (model/compile.py): the FlashAttention lookup done, so the graph reads its answer, and
    the per-row loop kept out of graphs (`torch.compiler.disable`: it runs eagerly, no graph for each set of lengths).
    Not at import: torch.compiler.disable imports torch._dynamo (a second and more), which `rl validate` never needs."""
    global _ATTEND_ROWS
    _flash_varlen()
    if _ATTEND_ROWS is _attend_rows:
        _ATTEND_ROWS = torch.compiler.disable(_attend_rows)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: tuple[int, ...], gqa: bool) -> torch.Tensor:
    outs = []
    for a, b in zip(offsets, offsets[1:]):
        outs.append(F.scaled_dot_product_attention(q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2),
                                                   v[:, a:b].transpose(1, 2), is_causal=True, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2)


_ATTEND_ROWS = _attend_rows
"""`_attend_rows`, kept out of compiled graphs once `prepare_for_compile` ran."""

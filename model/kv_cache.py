"""Paged KV cache: a pool of fixed-size blocks shared by all sequences.

A sequence owns a list of blocks; token j of the sequence lives in slot
`blocks[j // block_size] * block_size + j % block_size` of every layer's pool. Persisting a
sequence copies its slots to host memory, resuming writes them into freshly allocated blocks, and a
finished sequence returns its blocks at once (sample-grained GC, seed §5.2.3). K is stored after RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    pass


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # One slot past the pool is a scratch slot: padding writes land there, so `write` never needs
        # to look at the mask on the host (no sync in the token loop).
        self._scratch = num_blocks * block_size
        shape = (num_layers, num_blocks * block_size + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))

    # -- block bookkeeping -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [blocks[j // bs] * bs + j % bs for j in range(start, end)]

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer: 2 · kv_heads · head_dim · element size."""
        return 2 * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    # -- data movement -----------------------------------------------------------------------------
    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slot_mapping [B, T] (−1 = padding, sent to the scratch slot); k, v [B, T, KVH, D]."""
        flat = slot_mapping.reshape(-1)
        flat = torch.where(flat < 0, torch.full_like(flat, self._scratch), flat)
        kf, vf = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        self.k[layer].index_copy_(0, flat, kf.to(self.k.dtype))
        self.v[layer].index_copy_(0, flat, vf.to(self.v.dtype))

    def gather(self, layer: int, context_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context_slots [B, S] -> K, V [B, S, KVH, D]."""
        return self.k[layer][context_slots], self.v[layer][context_slots]

    def export(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the given slots of every layer to host memory: [L, n, KVH, D] each."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        return self.k[:, idx].to("cpu", copy=True), self.v[:, idx].to("cpu", copy=True)

    def load(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        self.k[:, idx] = k.to(self.k.device, self.k.dtype)
        self.v[:, idx] = v.to(self.v.device, self.v.dtype)


@dataclass
class PagedBatch:
    """Per-forward view of the cache: where this forward's tokens go and what context they see."""

    cache: PagedKVCache
    is_prefill: bool
    slot_mapping: torch.Tensor
    """[B, T] slot of each input token (−1 for padding)."""
    context_slots: torch.Tensor | None = None
    """Decode only: [B, S] slots of each sequence's context, current token included."""
    context_mask: torch.Tensor | None = None
    """Decode only: [B, 1, 1, S] True where the slot belongs to the sequence's context."""

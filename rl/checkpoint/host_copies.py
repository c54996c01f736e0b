"""Host memory that a background checkpoint copies the trainer's tensors into, kept from one checkpoint to the next.

A background checkpoint (rl/runtime/worker.py `PolicyWorker.save`) pauses the rollouts only while it copies the
weights and the optimizer state out of the trainer; a thread writes the copies while training goes on. Copying
every tensor into a fresh host allocation paid the page faults of ~1.6 GB each time (SmolLM2: float32 weights and two
AdamW moments) and, from a GPU, one synchronous device-to-host copy per tensor into pageable memory: most of the
~1.7 s pause of each checkpoint in the SmolLM2 job on an H200 (issue #41, BENCHMARKS.md). Here each tensor has its
buffer, allocated once and reused while its shape and dtype stay; from a CUDA device the buffers are pinned (up to
`pin_limit_bytes` in all; the rest pageable), every copy is queued (`non_blocking`) and the device is synchronised
once, in `end`.

One checkpoint at a time uses the buffers: the worker waits for the previous write before the next copy. Buffers
larger in all than `keep_limit_bytes` (a quarter of the host's memory by default) are not kept between checkpoints
(`end`): a large trainer's state (a 4B model's weights and AdamW moments are 48 GB) is copied into fresh memory each
time, as before, rather than held for the whole job.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Hashable

import torch

PIN_LIMIT_BYTES = 8 << 30
"""Pinned host memory at most, counted as torch's pinned allocator takes it (each block rounded up to a power of two);
pinned pages cannot be swapped: a trainer with more state gets pageable buffers beyond it, still reused."""


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostCopies:
    def __init__(self, pin_limit_bytes: int = PIN_LIMIT_BYTES, keep_limit_bytes: int | None = None):
        self.pin_limit_bytes = pin_limit_bytes
        self.keep_limit_bytes = _host_memory_bytes() // 4 if keep_limit_bytes is None else keep_limit_bytes
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._pinned: set[Hashable] = set()
        self._used: set[Hashable] = set()
        self._queued = False  # a CUDA copy may still be running: `end` synchronises
        self._pinned_total = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory the buffers take (each block rounded up as torch's pinned allocator rounds it)."""
        return self._pinned_total

    def tensor(self, key: Hashable, t: torch.Tensor, queued: bool = True) -> torch.Tensor:
        """`t`'s values in the host buffer of `key` (made or remade to `t`'s shape and dtype); valid after `end`.
        `queued=False`: copied before this returns (a temporary `t`, e.g. one gathered by a collective on another
        stream, whose memory may be reused as soon as it is dropped)."""
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            self._drop(key)
            pin = t.is_cuda and self._pinned_total + _pinned_size(t.nbytes) <= self.pin_limit_bytes
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            if pin:
                self._pinned.add(key)
                self._pinned_total += _pinned_size(buf.nbytes)
        buf.copy_(t, non_blocking=queued and t.is_cuda)  # into pinned memory: queued; pageable: copied now
        self._queued |= queued and t.is_cuda
        self._used.add(key)
        return buf

    def tree(self, tree, key: tuple = ()):
        """A state_dict tree (dicts, lists, tuples) with every tensor in its buffer (`tensor`), the rest deep-copied."""
        if torch.is_tensor(tree):
            return self.tensor(key, tree)
        if isinstance(tree, dict):
            return {k: self.tree(v, (*key, k)) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self.tree(v, (*key, i)) for i, v in enumerate(tree))
        return copy.deepcopy(tree)

    def end(self) -> None:
        """Every copy since the last `end` is complete. Buffers that none of them used are released, and all of them
        when they hold more than `keep_limit_bytes` (the copies returned stay valid: their holders keep them)."""
        if self._queued:
            torch.cuda.synchronize()
            self._queued = False
        for key in set(self._buffers) - self._used:
            self._drop(key)
        self._used = set()
        if self.nbytes > self.keep_limit_bytes:
            for key in list(self._buffers):
                self._drop(key)

    def _drop(self, key: Hashable) -> None:
        buf = self._buffers.pop(key, None)
        if key in self._pinned:
            self._pinned.discard(key)
            self._pinned_total -= _pinned_size(buf.nbytes)


def _pinned_size(nbytes: int) -> int:
    """What torch's pinned allocator takes for `nbytes`: a block of the next power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()

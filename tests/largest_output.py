"""A probe for tests of memory-bounded kernels: the largest tensor any op creates while it is active."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestOutput(TorchDispatchMode):
    """The largest tensor any op creates, in bytes (the Triton interpreter moves buffers as byte views)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out

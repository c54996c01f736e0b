"""Paged KV cache in bf16 | fp8 | fp4 storage formats, and the QAT fake-quant that mirrors it.

A sequence owns a list of blocks; token j of the sequence lives in slot
`blocks[j // block_size] * block_size + j % block_size` of every layer's pool. Persisting a
sequence copies its slots to host memory, resuming writes them into freshly allocated blocks, and a
finished sequence returns its blocks at once (sample-grained GC, seed §5.2.3). K is stored after RoPE.

Storage formats (`KVFormat`; seed §2.4.4, formats documented in `model.fp4` / `model.fp8`). A cached
row is one token of one KV head, D channels; K and V rows are stored alike:

    bf16  data [.., KVH, D] in the model dtype (unquantised)          2·D bytes per row in bf16
    fp8   data [.., KVH, D] uint8 (E4M3 bits) + scale [.., KVH] uint8  D + 1 bytes per row (E8M0 scale)
    fp4   data [.., KVH, D/2] uint8 (E2M1 pairs) + scale [.., KVH, D/16] uint8 (E4M3)
                                                                     D/2 + D/16 = D·4.5/8 bytes per row

The pool quantises on `write` and dequantises on `gather`; `export` / `load` move the stored bytes
untouched, so a persisted sequence resumes bit-exactly. `fake_quant` is the training side: the same
quantise -> dequantise (bit-identical to a cache write + read) with a straight-through gradient.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from model import fp4, fp8


class CacheFullError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------
# Storage formats
# ---------------------------------------------------------------------------------------------------------


class KVFormat:
    """How a K or V row [.., D] is stored: a data tensor plus (quantised formats) a scale tensor."""

    name: str = ""
    quantised: bool = True

    def data_shape(self, head_dim: int) -> tuple[int, ...]:
        raise NotImplementedError

    def scale_shape(self, head_dim: int) -> tuple[int, ...] | None:
        raise NotImplementedError

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [.., D] -> (data, scale or None) in storage dtypes."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def store(self, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> None:
        """Encode x [N, KVH, D] into rows `rows` [N] of a layer's pools (the decode write, nothing read back)."""
        q, s = self.encode(x)
        data.index_copy_(0, rows, q)
        scale.index_copy_(0, rows, s)

    def store_pair(self, k: torch.Tensor, v: torch.Tensor, k_pools: tuple[torch.Tensor, torch.Tensor],
                   v_pools: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> None:
        """`store` of K and of V into their pools (a format may do both at once)."""
        self.store(k, *k_pools, rows)
        self.store(v, *v_pools, rows)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) in x's dtype: exactly what a cache write followed by a read returns."""
        return self.decode(*self.encode(x), x.dtype)

    def bytes_per_row(self, head_dim: int, compute_dtype: torch.dtype) -> float:
        raise NotImplementedError

    def bytes_per_token_per_layer(self, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> float:
        """K and V of one token in one layer: 2 · KVH · bytes_per_row(D)."""
        return 2 * num_kv_heads * self.bytes_per_row(head_dim, compute_dtype)


class UnquantisedFormat(KVFormat):
    """`bf16`: K/V kept in the model's dtype, 2 · KVH · D · element size bytes per token per layer."""

    name, quantised = "bf16", False

    def data_shape(self, head_dim):
        return (head_dim,)

    def scale_shape(self, head_dim):
        return None

    def storage_dtype(self, compute_dtype):
        return compute_dtype

    def encode(self, x):
        return x, None

    def decode(self, data, scale, dtype):
        return data.to(dtype)

    def round_trip(self, x):
        return x

    def bytes_per_row(self, head_dim, compute_dtype):
        return head_dim * torch.empty((), dtype=compute_dtype).element_size()


class FP8Format(KVFormat):
    """`fp8` (model.fp8): D E4M3 values + one E8M0 scale byte per row: 2 · KVH · (D + 1) bytes."""

    name = "fp8"

    def data_shape(self, head_dim):
        return (head_dim,)

    def scale_shape(self, head_dim):
        return ()

    def encode(self, x):
        values, scale_bits = fp8.quantize(x)
        return values.view(torch.uint8), scale_bits

    def decode(self, data, scale, dtype):
        return fp8.dequantize(data.view(torch.float8_e4m3fn), scale, dtype)

    def bytes_per_row(self, head_dim, compute_dtype):
        return fp8.bytes_per_row(head_dim)


def _fp4_impl(x: torch.Tensor):
    """The Triton kernels on CUDA (bit-exact against the reference), the PyTorch reference elsewhere."""
    if x.is_cuda:
        from model.kernels import fp4 as kernels  # triton only where it runs compiled

        return kernels
    return fp4


class FP4Format(KVFormat):
    """`fp4` (model.fp4): E2M1 pairs + one E4M3 scale per 16 channels: 4.5 bits per value, so
    2 · KVH · D · 4.5 / 8 bytes per token per layer (seed §2.4.4)."""

    name = "fp4"

    def data_shape(self, head_dim):
        return (head_dim // 2,)

    def scale_shape(self, head_dim):
        return (head_dim // fp4.BLOCK,)

    def encode(self, x):
        packed, scales = _fp4_impl(x).quantize(x)
        return packed, scales.view(torch.uint8)

    def decode(self, data, scale, dtype):
        return _fp4_impl(data).dequantize(data, scale.view(torch.float8_e4m3fn), dtype)

    def store(self, x, data, scale, rows):
        if not x.is_cuda:
            return super().store(x, data, scale, rows)
        from model.kernels.fp4 import quantize_into  # one kernel: encoded straight into the rows

        quantize_into(x, data, scale, rows)

    def store_pair(self, k, v, k_pools, v_pools, rows):
        if not k.is_cuda:
            return super().store_pair(k, v, k_pools, v_pools, rows)
        from model.kernels.fp4 import quantize_pair_into  # one kernel for both, V read in place (no copy)

        quantize_pair_into(k, v, k_pools, v_pools, rows)

    def bytes_per_row(self, head_dim, compute_dtype):
        return head_dim * fp4.BITS_PER_VALUE / 8


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (UnquantisedFormat(), FP8Format(), FP4Format())}


def kv_format(name: str) -> KVFormat:
    if name not in KV_FORMATS:
        raise ValueError(f"unknown KV cache dtype {name!r}; known: {sorted(KV_FORMATS)}")
    return KV_FORMATS[name]


class _StraightThrough(torch.autograd.Function):
    """Forward: the cache's quantise -> dequantise; backward: identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        return fmt.round_trip(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quant(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """QAT (seed §2.4.4): the values a cache of format `fmt` would return for x, bit for bit, with the
    gradient passed straight through (d out / d x = I)."""
    if not fmt.quantised:
        return x
    return _StraightThrough.apply(x, fmt)


# ---------------------------------------------------------------------------------------------------------
# The paged pool
# ---------------------------------------------------------------------------------------------------------


QUANTISED_KV_MIN_CAPABILITY = (8, 9)
"""The FP8 and FP4 formats' paged decode-attention kernels on CUDA (model/kernels/decode_attention.py, and the Gluon
one) convert E4M3 values and scales with Triton's `float8e4nv`, which Triton offers from compute capability 8.9
(Ada, Hopper) on."""


class KVFormatDeviceError(ValueError):
    """A quantised KV format on a GPU its kernels cannot run on (`rl train` prints it, exit 2)."""


def quantised_kv_refusal(kv_dtype: str, device: str | torch.device) -> str | None:
    """Why `kv_dtype` cannot be the engine's KV format on `device` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda" or not kv_format(kv_dtype).quantised:
        return None
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) >= QUANTISED_KV_MIN_CAPABILITY:
        return None
    need = ".".join(map(str, QUANTISED_KV_MIN_CAPABILITY))
    return (f"model.kv_cache.dtype={kv_dtype} needs a GPU of compute capability {need} or newer (E4M3 conversions in "
            f"its attention kernels); {device} is {cap[0]}.{cap[1]}: use kv_cache.dtype bf16")


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
        kv_dtype: str = "bf16",
    ):
        """dtype: the model's compute dtype (what `gather` returns); kv_dtype: the storage format."""
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.format = kv_format(kv_dtype)
        if num_layers and (refusal := quantised_kv_refusal(kv_dtype, device)) is not None:
            raise KVFormatDeviceError(refusal)
        # One slot past the pool is a scratch slot: padding writes land there, so `write` never needs
        # to look at the mask on the host (no sync in the token loop).
        self._scratch = num_blocks * block_size
        lead = (num_layers, num_blocks * block_size + 1, num_kv_heads)
        sdt = self.format.storage_dtype(dtype)
        self.k = torch.zeros(lead + self.format.data_shape(head_dim), dtype=sdt, device=device)
        self.v = torch.zeros(lead + self.format.data_shape(head_dim), dtype=sdt, device=device)
        scale = self.format.scale_shape(head_dim)
        self.k_scale = None if scale is None else torch.zeros(lead + scale, dtype=torch.uint8, device=device)
        self.v_scale = None if scale is None else torch.zeros(lead + scale, dtype=torch.uint8, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        """Holders of each block: a block shared by several sequences (a GRPO group's prompt, rollout/
        engine.py) returns to the pool when its last holder frees it."""

    # -- block bookkeeping -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder of each of `blocks` (allocated ones); returns them."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated; only held blocks can be shared")
            self._refs[b] += 1
        return list(blocks)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def free(self, blocks: list[int]) -> None:
        """One holder lets go of each block; a block nobody holds any more goes back to the pool."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was allocated or shared")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's slots of block `src` into block `dst`, in the storage format (copy on write
        of a shared prompt's last, partly filled block)."""
        bs = self.block_size
        for t in self._tensors().values():
            t[:, dst * bs : (dst + 1) * bs] = t[:, src * bs : (src + 1) * bs]

    def slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [blocks[j // bs] * bs + j % bs for j in range(start, end)]

    @property
    def bytes_per_token_per_layer(self) -> float:
        """K and V of one token in one layer (seed §2.4.4), by format, KVH kv heads of D channels:
        bf16: 2·KVH·D·elem;  fp8: 2·KVH·(D + 1);  fp4: 2·KVH·D·4.5/8 (4 bits + one 8-bit scale per 16)."""
        return self.format.bytes_per_token_per_layer(self.num_kv_heads, self.head_dim, self.dtype)

    def _tensors(self) -> dict[str, torch.Tensor]:
        t = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            t["k_scale"], t["v_scale"] = self.k_scale, self.v_scale
        return t

    @property
    def pool_bytes_per_slot_per_layer(self) -> float:
        """Actual bytes the pool's tensors hold per (slot, layer); equals bytes_per_token_per_layer."""
        total = sum(t.numel() * t.element_size() for t in self._tensors().values())
        return total / (self.k.shape[0] * self.k.shape[1])

    # -- data movement -----------------------------------------------------------------------------
    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, read_back: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """slot_mapping [B, T] (−1 = padding, sent to the scratch slot); k, v [B, T, KVH, D].
        Returns K, V as the cache will give them back (dequantised; k, v themselves for bf16); with
        `read_back=False` (decode through the paged kernel, which reads the cache itself) nothing, and the rows
        are encoded straight into the pool where the format can (`KVFormat.store_pair`; fp4 on CUDA: one kernel
        for K and V, V read in place)."""
        flat = slot_mapping.reshape(-1)
        flat = flat.masked_fill(flat < 0, self._scratch)  # two kernels (a where over a full_like took three)
        if self.format.quantised and not read_back:
            self.format.store_pair(k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                   (self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer]), flat)
            return None
        out = []
        for x, data, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            if not self.format.quantised:
                data[layer].index_copy_(0, flat, x.reshape(-1, *x.shape[2:]).to(data.dtype))
                out.append(x)
                continue
            q, s = self.format.encode(x)
            data[layer].index_copy_(0, flat, q.reshape(-1, *q.shape[2:]))
            scale[layer].index_copy_(0, flat, s.reshape(-1, *s.shape[2:]))
            out.append(self.format.decode(q, s, x.dtype))
        return (out[0], out[1]) if read_back else None

    def unquantised_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The bf16 format: this layer's K and V pools [slots + 1, KVH, D] and the scratch slot, for a kernel
        that writes K/V rows in place with `write`'s semantics (model/kernels/decode_fused.py writes them in
        the same kernel as RoPE); None for quantised formats, whose rows are encoded by `write`."""
        if self.format.quantised:
            return None
        return self.k[layer], self.v[layer], self._scratch

    def fp4_layer(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int] | None:
        """The fp4 format: this layer's (packed, scales) pools of K and of V and the scratch slot, for a decode kernel
        that encodes K/V rows into them with `write`'s semantics (model/kernels/decode_fused.py, with RoPE: one
        launch a layer instead of two); None for other formats, or where ASYNCRL_FP4_FUSED_WRITE=0."""
        if self.format.name != "fp4" or os.environ.get("ASYNCRL_FP4_FUSED_WRITE", "1") == "0":
            return None
        return (self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer]), self._scratch

    def gather(self, layer: int, context_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context_slots [B, S] -> K, V [B, S, KVH, D] in the compute dtype (dequantised)."""
        if not self.format.quantised:
            return self.k[layer][context_slots], self.v[layer][context_slots]
        return tuple(
            self.format.decode(data[layer][context_slots], scale[layer][context_slots], self.dtype)
            for data, scale in ((self.k, self.k_scale), (self.v, self.v_scale))
        )

    def attend(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """Decode attention of one query token per sequence over its paged context, read in the storage
        format with no gathered or dequantised copy (model/kernels/decode_attention.py, Triton):
        q [B, H, D], block_table [B, max_blocks], context_lens [B] (0: a padding row, zero output) -> [B, H, D]."""
        from model.kernels.decode_attention import decode_attention  # triton: only where decode runs it

        k = self.k[layer] if self.k_scale is None else (self.k[layer], self.k_scale[layer])
        v = self.v[layer] if self.v_scale is None else (self.v[layer], self.v_scale[layer])
        fmt = "dense" if not self.format.quantised else self.format.name
        return decode_attention(q, k, v, block_table, context_lens, self.block_size, kv_format=fmt)

    def export(self, slot_lists: list[list[int]], to_host: bool = True) -> list[dict[str, torch.Tensor]]:
        """Copy each sequence's slots of every layer out of the pool, in the storage format: one gather per pool
        tensor for all of them, then (`to_host`) one copy to host memory; each sequence gets views of the copy:
        {"k", "v"} [L, n, KVH, ...] (+ {"k_scale", "v_scale"} for quantised formats). A per-sequence gather and
        copy (a sync each) cost ~0.1 ms a sequence on an H200, ~60 s of an 8-minute GRPO run (BENCHMARKS.md)."""
        flat = [i for slots in slot_lists for i in slots]
        idx = torch.tensor(flat, dtype=torch.long, device=self.k.device)
        out = {n: t[:, idx] for n, t in self._tensors().items()}
        if to_host:
            out = {n: t.to("cpu") for n, t in out.items()}
        views, start = [], 0
        for slots in slot_lists:
            views.append({n: t[:, start:start + len(slots)] for n, t in out.items()})
            start += len(slots)
        return views

    def load(self, pairs: list[tuple[list[int], dict[str, torch.Tensor]]]) -> None:
        """Inverse of `export`: write stored bytes back into the given slots, untouched; all pairs (slots,
        tensors) in one scatter per pool tensor."""
        mine = self._tensors()
        for _, tensors in pairs:
            if tensors.keys() != mine.keys():
                raise ValueError(f"KV state has {sorted(tensors)}; a {self.format.name} cache stores {sorted(mine)}")
        if not pairs:
            return
        idx = torch.tensor([i for slots, _ in pairs for i in slots], dtype=torch.long, device=self.k.device)
        for n, t in mine.items():
            srcs = [tensors[n] for _, tensors in pairs]
            if len({x.device for x in srcs}) > 1:  # parked on the device and read from a checkpoint: rare
                srcs = [x.to(t.device) for x in srcs]
            t[:, idx] = torch.cat(srcs, dim=1).to(t.device, t.dtype)  # joined where they are, then one copy


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
    block_table: torch.Tensor | None = None
    """Decode through the paged kernel (`PagedKVCache.attend`): [B, max_blocks] block ids; then
    context_slots and context_mask are unused."""
    context_lens: torch.Tensor | None = None
    """With block_table: [B] tokens of context per sequence, this one included (0: padding row)."""

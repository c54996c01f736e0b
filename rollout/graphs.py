"""CUDA graphs of the decode step (issue #15): one graph per batch-size bucket and context bucket, replayed every step.

An eager decode step of a small model is launch-bound: ~20 kernels per layer, each ~7 us to launch and
each waiting on Python, so a 30-layer model spends tens of milliseconds per token on the host whatever the
batch. A graph replays the whole step's kernels with one launch (~1 us each on the device).

What is captured: for a bucket of `b` rows (the next power of two at or above the batch, up to
`max_batch_size`), the dense model's forward of one token per row over the paged cache, from one static
int64 input buffer [b, 3 + max_blocks] = (token id, position, valid, block table padded with block 0)
to the static float32 logits [b, V]. This token's slot and the context lengths are computed from it inside
the graph, and attention reads the paged cache through the decode kernel (model/kernels/decode_attention.py:
the storage format, bf16/fp8/fp4, read in place, no gathered copy); without it (`paged_decode_kernel:
false`, or a head_dim the kernel does not take) the graph gathers a fixed context of max_blocks ·
block_size slots, masked beyond each row's position, for SDPA. Either way the shapes never change. Each batch
bucket is captured at several block-table widths (`context_buckets`: 512 tokens, doubling, up to max_seq_len) and a
step replays the narrowest that holds its longest context, so a 16K cap costs a step of short contexts nothing. Rows
past the batch are invalid: their K/V go to the cache's scratch slot (`PagedKVCache.write` sends slot −1
there), they have no context, and their logits are ignored. A
step is one host-to-device copy of the input buffer and one replay; the graph also samples each row's next token
(the counter-based sampler at top_p = 1, `EngineConfig.sample_in_graph`; on CUDA three kernels, model/kernels/sampling.py), which the engine reads when the step
has no prefill, no tool output and no top_p < 1 row, and otherwise samples the logits after the replay.

The graphs read the model's parameters and the cache's tensors where they are: the trainer updates the
shared weights in place (rl/runtime/worker.py), so new weights need no recapture. The captured forward is the model's
rollout path (model/fused.py: q/k/v and gate/up as one GEMM each, fused norm/RoPE/cache-write, SwiGLU and
residual-add+norm kernels), turned on here; its concatenated weights are views of the parameters (a frozen
model, such as the worker's rollout copy) or copies refreshed in place, and every replay first checks them
against the parameters' version counters (`Decoder.refresh_rollout_weights`), so an in-place update that
nobody announced is still seen. MoE decode is captured
when its routed experts run through the grouped kernels (`fused.GROUPED_EXPERTS`, model/kernels/moe.py: no host
read); the graph then also returns each row's expert ids, which the engine copies to pinned host memory with the
step's tokens (no read of its own). Models the graph cannot hold (MoE through the expert loop, which reads counts
on the host; CSA2: per-sequence caches) decode eagerly, as does any model whose capture fails (the error is kept
in `DecodeGraphs.disabled_reason`).
"""

from __future__ import annotations

import numpy as np
import torch

from model import fused
from model.kv_cache import PagedBatch, PagedKVCache
from rollout.sampling import sample_tokens

_COLS = 6
"""Leading columns of the input buffer: token id, position, valid (1) or padding (0), then the sampling inputs of
the row: seed, counter, temperature (its float32 bits)."""


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, then max_batch_size itself."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


def capture(fn, buf: torch.Tensor, pool) -> tuple:
    """`fn(buf)` captured in a CUDA graph in memory pool `pool`, after two warm-up calls on a side stream (allocator,
    lazy inits, Triton compiles; `buf` holds padding only, so they write the cache's scratch slot): (graph, buf,
    the captured outputs, two pinned host buffers of buf's shape, which the caller fills in turn)."""
    side = torch.cuda.Stream(buf.device)
    side.wait_stream(torch.cuda.current_stream(buf.device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(buf)
    torch.cuda.current_stream(buf.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(buf)
    return graph, buf, out, [torch.zeros(buf.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]


class DecodeGraphs:
    def __init__(self, model, cache: PagedKVCache, max_batch_size: int, max_blocks: int, paged_kernel: bool = True):
        self.model, self.cache, self.max_blocks = model, cache, max_blocks
        self.buckets = batch_buckets(max_batch_size)
        self.context_buckets = context_buckets(max_blocks, cache.block_size)
        """Block-table widths graphs are captured at (`context_buckets`): a step is replayed from the graph of the
        narrowest width that holds its longest context, so its attention is planned (split-K grid, tile sizes, the
        gathered context without the paged kernel) for the contexts it has, not for max_seq_len (issue #42: at a 16K
        cap an FP4 step of ~330-token contexts took twice as long as at a 2K cap)."""
        self.device = cache.k.device
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, torch.Tensor], list[torch.Tensor]]] = {}
        """(batch bucket, context blocks) -> (graph, device input buffer, device (logits, sampled), two pinned host
        input buffers used in turn)."""
        self._last: dict[int, tuple[int, int]] = {}  # batch bucket -> the key it last replayed
        self._pool = None
        self.disabled_reason: str | None = None
        d = model.config.head_dim
        self.paged_kernel = paged_kernel and d >= 16 and d & (d - 1) == 0
        """Attention through the paged decode kernel (its head_dim must be a power of two >= 16); else
        a gather of a fixed max_blocks · block_size context and SDPA."""
        self.replays = 0
        if fused.ENABLED:  # a model nobody trains shares storage with its fused weights (model/fused.py)
            model.enable_rollout_fusion(share_storage=not any(p.requires_grad for p in model.parameters()))

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def context_bucket(self, context: int) -> int:
        """The narrowest captured block-table width that holds `context` tokens."""
        need = -(-context // self.cache.block_size)
        return next((c for c in self.context_buckets if c >= need), self.max_blocks)

    def captured(self, batch: int) -> "torch.cuda.CUDAGraph | None":
        """The graph last replayed for `batch` rows, once captured (bench/decode_profile.py times its replay)."""
        entry = self._graphs.get(self._last.get(self.bucket(batch)))
        return None if entry is None else entry[0]

    def forward_eagerly(self, batch: int):
        """The computation of the graph last replayed for `batch`'s bucket run once more, eagerly, on the graph's own
        input buffer (the last step's inputs: it writes the K/V that step wrote again, with the same values): the
        kernels the graph holds, one launch each, for a profiler (bench/decode_profile.py). It must have been captured."""
        key = self._last[self.bucket(batch)]
        return self._forward(self._graphs[key][1], key[1])

    def _forward(self, buf: torch.Tensor, context_blocks: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The captured computation: input buffer [b, _COLS + max_blocks], of whose block tables the first
        `context_blocks` (default all) are read -> (next-token logits [b, V] in the head's dtype, the rows' tokens and
        logprobs sampled from them [2, b] float64, as `rollout/sampling.sample_tokens` draws them for top_p = 1 (on
        CUDA three kernels: model/kernels/sampling.py); MoE: the expert ids each row's token chose
        [b, num_layers, top_k], else None)."""
        nb = self.max_blocks if context_blocks is None else context_blocks
        bs, S = self.cache.block_size, nb * self.cache.block_size
        ids, pos, valid, tables = buf[:, 0:1], buf[:, 1:2], buf[:, 2:3], buf[:, _COLS:_COLS + nb]
        slot = tables.gather(1, pos // bs) * bs + pos % bs
        slot = torch.where(valid > 0, slot, torch.full_like(pos, -1))  # padding -> the scratch slot
        if self.paged_kernel:  # attention reads the paged cache itself; padding rows have no context
            lens = torch.where(valid > 0, pos + 1, torch.zeros_like(pos))[:, 0]
            batch = PagedBatch(self.cache, False, slot, block_table=tables, context_lens=lens)
        else:
            ctx = (tables[:, :, None] * bs + torch.arange(bs, device=buf.device)).reshape(buf.shape[0], S)
            mask = (torch.arange(S, device=buf.device)[None, :] <= pos)[:, None, None, :]
            batch = PagedBatch(self.cache, False, slot, ctx, mask)
        out = self.model.forward_hidden(ids, pos, batch=batch)
        # the head's own dtype (bf16 under mixed precision): the sampler reads it as is, no float32 copy of [b, V]
        logits, routing = fused.linear(out.hidden[:, 0], self.model.lm_head.weight), out.routing
        temperature = buf[:, 5].to(torch.int32).view(torch.float32)
        tokens, logprobs = sample_tokens(logits, temperature, torch.ones_like(temperature), buf[:, 3], buf[:, 4], nucleus=False)
        return logits, torch.stack([tokens.double(), logprobs.double()]), None if routing is None else routing[:, 0]

    def _capture(self, b: int, context_blocks: int):
        buf = torch.zeros(b, _COLS + self.max_blocks, dtype=torch.long, device=self.device)  # all padding
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture(lambda x: self._forward(x, context_blocks), buf, self._pool)

    def run(self, ids: torch.Tensor, positions: list[int], tables: list[list[int]],
            sampling: tuple[list[int], list[int], list[float]] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(next-token logits [B, V], sampled [2, B], MoE expert ids [B, num_layers, top_k] or None) of one decode
        step, all on the device, or None when graphs are off (decode eagerly). `ids` [B] on the device (the rows'
        last tokens, possibly sampled by a step whose output the host has not read). `sampling` = the rows'
        (seeds, counters, temperatures): `sampled` holds their tokens and logprobs drawn at top_p = 1 (without it,
        temperature 0 rows: ignore `sampled`)."""
        if self.disabled_reason is not None:
            return None
        B = len(positions)
        b = self.bucket(B)
        key = (b, self.context_bucket(max(positions) + 1))
        self.model.refresh_rollout_weights()  # in place, outside the graph: the graph reads the buffers
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(*key)
            except Exception as e:  # noqa: BLE001 - any capture failure means: decode eagerly from now on
                self.disabled_reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                self._graphs.clear()
                return None
        self._last[b] = key
        graph, buf, out, hosts = self._graphs[key]
        # pinned, used every other step: with overlapped steps the last copy may still be queued, the one
        # before it ran ahead of a step whose tokens the engine has read
        host = hosts[self.replays % 2]
        h = host.numpy()[:, :_COLS + key[1]]  # the graph reads the first key[1] blocks of each table
        h[:] = 0
        h[:B, 1], h[:B, 2] = positions, 1
        if sampling is not None:
            h[:B, 3], h[:B, 4] = sampling[0], sampling[1]
            h[:B, 5] = np.asarray(sampling[2], dtype=np.float32).view(np.int32)
        for i, t in enumerate(tables):
            n = min(len(t), key[1])
            h[i, _COLS:_COLS + n] = t[:n]
        buf.copy_(host, non_blocking=True)
        buf[:B, 0].copy_(ids)
        graph.replay()
        self.replays += 1
        return out[0][:B], out[1][:, :B], None if out[2] is None else out[2][:B]


CONTEXT_BUCKET_TOKENS = 512
"""The narrowest decode graph's context (`context_buckets`), in tokens; each next one twice as wide."""


def context_buckets(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths of the decode graphs: CONTEXT_BUCKET_TOKENS' blocks, doubling, then max_blocks itself."""
    out, n = [], max(1, CONTEXT_BUCKET_TOKENS // block_size)
    while n < max_blocks:
        out.append(n)
        n *= 2
    return out + [max_blocks]


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """16, 32, 64, ... below max_tokens, then max_tokens itself."""
    out, t = [], smallest
    while t < max_tokens:
        out.append(t)
        t *= 2
    return out + [max_tokens]


class PrefillGraphs:
    """CUDA graphs of the prefill forward (issue #15, `EngineConfig.prefill_graphs`), one per (rows, tokens)
    bucket, captured when a prefill first needs it. An eager prefill of a small model is launch-bound like an eager
    decode step: under sample-level dispatch on an H200 (bench/async_dispatch.py's MoE model, float32, py-spy) each
    prefill call spent ~24 ms on the host and prefills took 28% of the engine's time, where the graphed decode step
    of 245 rows took ~20 ms in all.

    What is captured: for `r` rows of `t` tokens (rows a power of two up to `max_rows`, tokens one from 16 up to
    `max_tokens`, at most `max_graph_tokens` = r·t), the model's forward over right-padded prompts with their slot
    mapping and the logits at each row's last prompt position, from one static int64 input buffer [r, 2t + 1] =
    (token ids, slots, last position), to (logits [r, V] float32, MoE expert ids [r, t, num_layers, top_k] or
    None). Padding is token 0 at slot −1 (the cache's scratch slot): causal attention keeps a real token from
    seeing the padding after it and the grouped expert kernels have no capacity, so padding changes nothing a
    real token computes (bits aside, where a GEMM's algorithm depends on the row count). A prefill larger than
    every bucket runs eagerly. The graphs have a memory pool of their own: the decode graph replayed later in the
    same step must not overwrite the prefill's logits before the step samples them. `capture=False` (CPU, tests)
    runs the same padded computation eagerly.
    """

    def __init__(self, model, cache: PagedKVCache, max_rows: int, max_tokens: int, max_graph_tokens: int = 8192,
                 capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self.row_buckets = batch_buckets(max_rows)
        self.token_buckets = token_buckets(max_tokens)
        self.max_graph_tokens = max_graph_tokens
        self.device = cache.k.device
        self._graphs: dict[tuple[int, int], tuple] = {}
        """(rows, tokens) -> (graph, device input buffer, device outputs, two pinned host input buffers used in turn)."""
        self._pool = None
        self.disabled_reason: str | None = None
        self.replays = 0

    def bucket(self, rows: int, tokens: int) -> tuple[int, int] | None:
        """The (rows, tokens) bucket a prefill of `rows` prompts of at most `tokens` tokens runs in; None: eagerly."""
        if rows > self.row_buckets[-1] or tokens > self.token_buckets[-1]:
            return None
        b = next(r for r in self.row_buckets if r >= rows), next(t for t in self.token_buckets if t >= tokens)
        return b if b[0] * b[1] <= self.max_graph_tokens else None

    def forward(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured computation: input buffer [r, 2t + 1] -> (logits at each row's last position [r, V] float32,
        MoE expert ids [r, t, num_layers, top_k] or None)."""
        t = (buf.shape[1] - 1) // 2
        ids, slots, last = buf[:, :t], buf[:, t:2 * t], buf[:, 2 * t]
        out = self.model.forward_hidden(ids, batch=PagedBatch(self.cache, is_prefill=True, slot_mapping=slots))
        logits = self.model.logits(out.hidden[torch.arange(buf.shape[0], device=buf.device), last])
        return logits, out.routing

    @staticmethod
    def fill(h: np.ndarray, tokens: list, slots: list[list[int]]) -> None:
        """Write prompts and their slots into a host input buffer [r, 2t + 1] (the rest: padding)."""
        t = (h.shape[1] - 1) // 2
        h[:] = 0
        h[:, t:2 * t] = -1
        for i, (ids, sl) in enumerate(zip(tokens, slots)):
            n = len(ids)
            h[i, :n], h[i, t:t + n], h[i, 2 * t] = ids, sl, n - 1

    def _capture(self, r: int, t: int):
        buf = torch.zeros(r, 2 * t + 1, dtype=torch.long, device=self.device)
        buf[:, t:2 * t] = -1  # all padding: warm-up and capture write only the scratch slot
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture(self.forward, buf, self._pool)

    def run(self, tokens: list, slots: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Prefill `tokens` (each row's prompt ids) written at `slots`: (logits at each last position [n, V], MoE
        expert ids [n, t, num_layers, top_k] (t: the bucket's tokens) or None), on the device; None when no bucket
        holds the prefill or capture failed (prefill eagerly)."""
        b = self.bucket(len(tokens), max(len(x) for x in tokens))
        if b is None or self.disabled_reason is not None:
            return None
        n, (r, t) = len(tokens), b
        self.model.refresh_rollout_weights()  # in place, outside the graph: the graph reads the buffers
        if not self.capture:  # the same padded computation, eagerly (CPU, tests)
            h = np.zeros((r, 2 * t + 1), dtype=np.int64)
            self.fill(h, tokens, slots)
            logits, routing = self.forward(torch.from_numpy(h).to(self.device))
            self.replays += 1
            return logits[:n], None if routing is None else routing[:n]
        if b not in self._graphs:
            try:
                self._graphs[b] = self._capture(r, t)
            except Exception as e:  # noqa: BLE001 - any capture failure means: prefill eagerly from now on
                self.disabled_reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                self._graphs.clear()
                return None
        graph, buf, out, hosts = self._graphs[b]
        host = hosts[self.replays % 2]  # in turn: the copy queued by the previous prefill may not have run yet
        self.fill(host.numpy(), tokens, slots)
        buf.copy_(host, non_blocking=True)
        graph.replay()
        self.replays += 1
        return out[0][:n], None if out[1] is None else out[1][:n]

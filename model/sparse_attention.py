"""CSA2 sparse attention (seed §2.3): compressed main KV, a lightweight indexer, top-k + sliding window.

Per layer (seed §2.3, §2.3.1), every mode computes its own query and its own sliding-window (SWA) KV
over the last `window` raw tokens; they differ in where the main KV entries and the top-k come from:

- Full:    projects raw main KV, compresses every m consecutive tokens into one entry (softmax-weighted
           pooling, no overlap, no positional embedding: the CSA2 compressor), projects indexer K from
           those entries, scores them with its own indexer Q and picks its own top-k.
- Reindex: reuses the latest Full layer's entries and indexer K, scores them with its own indexer Q
           and picks its own top-k.
- Reuse:   reuses the latest entries and the latest top-k indices; no indexer at all.

Shared entries are computed once and travel layer to layer in a per-forward `SharedState`; in the
engine they are stored once per Full layer in `CSA2Cache`. The hierarchical indexer (seed §2.3.2): the
first Full layer at or after `hierarchical.from_layer` also keeps, per query, the positions of its
top-scoring blocks (block score = max entry score) as a candidate pool; later Reindex layers score only
that pool. The same code runs in training and decode, so the restriction is training-aware.

Visibility (causal): entry j pools tokens [j·m, (j+1)·m); a query at position t sees it only once the
whole group is in the past, i.e. j < (t+1) // m. Its key is rotated (RoPE) at the group's last position
(j+1)·m - 1, so query-entry distances are never negative. Positions are 0..T-1 per sequence (training,
right padding is causal-safe) or continue from the cache length (prefill chunks, decode).

Indexer (seed §2.3 / DeepSeek-V3.2 lightning indexer): I(t, j) = Σ_h w_{t,h} · relu(q_{t,h} · k_j). Its
inputs are detached from the main graph, so only `indexer_loss` (seed §3.1.2) trains it, and that loss
reaches no main-attention parameter. Top-k uses a stable sort (ties go to the earlier entry), so the
full forward, the decode step and a covering candidate pool select identical sets.

KV formats (seed §2.4.4, `ModelConfig.kv_cache`): the compressed main KV entries take `kv_cache.dtype`
(fp4 in DeepSeek-V4.1-Flash) and, when that is quantised, the SWA KV is kept in FP8 ("due to its
sensitivity to quantization"); both are quantised after RoPE. With a cache the layer stores the packed
bytes (`CSA2LayerCache.*_scale` hold the scales) and attends over their dequantised values; the
training forward with `kv_cache.qat` applies the bit-identical round trip (`model.kv_cache.fake_quant`,
straight-through gradient). Indexer K stays unquantised.

Reference implementation in plain PyTorch: the training path gathers [B, T, topk + window] keys per
query, which is fine for unit tests and small models; a fused kernel replaces it at scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig, SparseAttentionConfig
from model.kv_cache import KVFormat, fake_quant, kv_format

NEG_INF = float("-inf")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / score dtype: float32, or float64 when the inputs are float64 (exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, H, D] rotated at integer positions [T]; rotate-half convention of `model.decoder.apply_rope`.
    (A local copy: `model.decoder` will import this module, so importing it back would be circular.)"""
    d, ct = x.shape[-1], _compute_dtype(x.dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :].to(ct)  # [T, 1, D]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.to(ct) * emb.cos() + rotated.to(ct) * emb.sin()).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Pure pieces: compressor, indexer score, selection, candidate pool. Shapes in the docstrings.
# ---------------------------------------------------------------------------------------------------------


def compress(raw: torch.Tensor, gate: torch.Tensor, m: int) -> torch.Tensor:
    """raw [B, n·m, KVH, C], gate [B, n·m, KVH] -> entries [B, n, KVH, C].

    seed §2.3 (CSA2 compressor): entry_j = Σ_{i in group j} softmax_i(gate_i) · raw_i over the m tokens of
    group j; groups do not overlap and carry no positional embedding. m = 1 returns raw unchanged."""
    B, L, H, C = raw.shape
    n = L // m
    w = gate[:, : n * m].view(B, n, m, H).to(_compute_dtype(gate.dtype)).softmax(dim=2)
    return (raw[:, : n * m].view(B, n, m, H, C) * w.unsqueeze(-1).to(raw.dtype)).sum(dim=2)


def index_scores(q_index: torch.Tensor, w_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
    """q_index [B, T, HI, DI], w_index [B, T, HI]; k_index [B, N, DI] (all entries) or [B, T, N, DI]
    (per-query candidates) -> scores [B, T, N] (float32, or float64 for float64 inputs).

    seed §2.3 / DeepSeek-V3.2 lightning indexer: I(t, j) = Σ_h w_{t,h} · relu(q_{t,h} · k_j)."""
    if k_index.dim() == 3:
        dots = torch.einsum("bthd,bnd->bthn", q_index, k_index)
    else:
        dots = torch.einsum("bthd,btnd->bthn", q_index, k_index)
    ct = _compute_dtype(dots.dtype)
    return torch.einsum("bthn,bth->btn", dots.to(ct).relu(), w_index.to(ct))


@dataclass
class Selection:
    """Top-k main KV entries per query: what a layer attends to besides its window."""

    ids: torch.Tensor
    """[B, T, topk] int64 entry indices (0 where invalid)."""
    valid: torch.Tensor
    """[B, T, topk] bool: False where the query has fewer than topk visible candidates."""
    order: torch.Tensor
    """[B, T, topk] int64 position of each pick in the scored candidate list (to gather its score)."""


def select_topk(scores: torch.Tensor, k: int, candidates: torch.Tensor | None = None) -> Selection:
    """scores [B, T, C] with -inf where a candidate is not visible; candidates [B, T, C] entry ids (None:
    candidate c is entry c). Stable descending sort, so ties go to the earlier candidate and any two
    paths that score the same entries in the same order pick the same set."""
    C = scores.shape[-1]
    if C < k:
        scores = F.pad(scores, (0, k - C), value=NEG_INF)
    vals, order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True)
    vals, order = vals[..., :k], order[..., :k]
    valid = vals > NEG_INF
    order = torch.where(valid, order, 0)
    ids = order if candidates is None else candidates.gather(-1, order)
    return Selection(torch.where(valid, ids, 0), valid, order)


def visible_mask(n_visible: torch.Tensor, n: int) -> torch.Tensor:
    """n_visible [T] -> [T, n] bool: entry j is visible to query t iff j < n_visible[t]."""
    return torch.arange(n, device=n_visible.device)[None, :] < n_visible[:, None]


def build_candidate_pool(
    scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, T, N] (-inf where not visible), n_visible [T] -> candidate_pool [B, T, P] entry ids in
    ascending order, pool_valid [B, T, P]; P = min(num_blocks, ceil(N / block_size)) · block_size.

    seed §2.3.2: each block of block_size consecutive entries scores the max index score among its
    entries; the num_blocks best blocks are kept and the pool is every position they cover."""
    B, T, N = scores.shape
    n_blocks = -(-N // block_size)
    s = F.pad(scores.detach(), (0, n_blocks * block_size - N), value=NEG_INF)
    block_score = s.view(B, T, n_blocks, block_size).amax(dim=-1)
    keep = min(num_blocks, n_blocks)
    vals, blocks = torch.sort(block_score, dim=-1, descending=True, stable=True)
    blocks, block_valid = blocks[..., :keep], vals[..., :keep] > NEG_INF
    blocks, perm = torch.sort(blocks, dim=-1)  # ascending entry order, as the flat indexer scans
    block_valid = block_valid.gather(-1, perm)
    offs = torch.arange(block_size, device=scores.device)
    pool = (blocks.unsqueeze(-1) * block_size + offs).flatten(-2)
    pool_valid = block_valid.repeat_interleave(block_size, dim=-1) & (pool < n_visible[None, :, None])
    return torch.where(pool_valid, pool, 0), pool_valid


POOL_KERNEL = True
"""Score candidate pools with the fused Triton kernel (`model.kernels.indexer`) where it applies: CUDA,
bf16/fp16/fp32, no gradient needed (decode, eval). bench/indexer.py --no-pool-kernel turns it off."""


def pool_index_scores(q_index: torch.Tensor, w_index: torch.Tensor, k_index: torch.Tensor,
                      pool: torch.Tensor, pool_valid: torch.Tensor) -> torch.Tensor:
    """q_index [B, T, HI, DI], w_index [B, T, HI], k_index [B, N, DI], candidate pool [B, T, P] entry ids
    and pool_valid [B, T, P] -> scores [B, T, P] (-inf where not valid): `index_scores` of each query's
    pool entries. The fused kernel reads each pool row of indexer K once (no [B, T, P, DI] gather, no
    [B, T, HI, P] intermediates) and matches this reference up to float32 summation order; the reference
    runs where a gradient is needed (indexer loss) and off CUDA, gathering rows with one index_select."""
    needs_grad = torch.is_grad_enabled() and (q_index.requires_grad or w_index.requires_grad or k_index.requires_grad)
    if POOL_KERNEL and q_index.is_cuda and not needs_grad:
        from model.kernels import indexer as _kern  # lazy: Triton is only needed on CUDA

        if _kern.supports(q_index, w_index, k_index):
            return _kern.pool_scores(q_index, w_index, k_index, pool, pool_valid)
    B, N, DI = k_index.shape
    if N == 0:
        k = k_index.new_zeros(*pool.shape, DI)
    else:  # rows b·N + id of the flattened store: one contiguous-row gather (the same values as k[b, id])
        rows = (pool + torch.arange(B, device=pool.device).view(B, 1, 1) * N).flatten()
        k = k_index.reshape(B * N, DI).index_select(0, rows).view(*pool.shape, DI)
    return index_scores(q_index, w_index, k).masked_fill(~pool_valid, NEG_INF)


def _gather_per_query(entries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """entries [B, N, ...], ids [B, T, K] -> [B, T, K, ...] (zeros when N = 0)."""
    B, N = entries.shape[:2]
    if N == 0:
        return entries.new_zeros(*ids.shape, *entries.shape[2:])
    b = torch.arange(B, device=ids.device).view(B, 1, 1)
    return entries[b, ids]


def _windows(seq: torch.Tensor, n_new: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq [B, Lp + n_new, KVH, D] (Lp <= window-1 past tokens, then the new ones) -> keys of each new
    query's window [B, n_new, window, KVH, D] (oldest first, the query itself last), valid [n_new, window]."""
    Lp = seq.shape[1] - n_new
    padded = F.pad(seq, (0, 0, 0, 0, window - 1, 0))
    win = padded.unfold(1, window, 1)[:, Lp : Lp + n_new]  # [B, n_new, KVH, D, window]
    idx = torch.arange(n_new, device=seq.device)[:, None] + Lp + torch.arange(window, device=seq.device)
    return win.permute(0, 1, 4, 2, 3), idx >= window - 1


# ---------------------------------------------------------------------------------------------------------
# Per-forward shared state and the per-sequence decode cache
# ---------------------------------------------------------------------------------------------------------


@dataclass
class SharedState:
    """What CSA2 layers hand down within one forward (seed §2.3.1; the shared state of seed §3.1.2).

    Create one per forward (training step, prefill chunk or decode step) and pass it to every layer in
    order. A Full layer overwrites main KV / indexer K / top-k; a Reindex layer overwrites top-k."""

    compute_indexer_loss: bool = False
    """Training: every indexing layer adds its indexer KL (seed §3.1.2) to `indexer_losses`."""
    query_mask: torch.Tensor | None = None
    """[B, T] bool: the queries whose indexer KL counts (real tokens, not right padding); None: all."""
    main_k: torch.Tensor | None = None
    """[B, N, KVH, D] latest Full layer's compressed main K (after RoPE at the group's last position)."""
    main_v: torch.Tensor | None = None
    """[B, N, KVH, D] its compressed main V."""
    index_k: torch.Tensor | None = None
    """[B, N, DI] indexer K projected from those entries (after RoPE)."""
    source_layer: int | None = None
    """Layer that produced main_k/main_v/index_k."""
    topk: Selection | None = None
    """Latest top-k against the current main KV (Full or Reindex), for Reuse layers."""
    candidate_pool: tuple[torch.Tensor, torch.Tensor] | None = None
    """Hierarchical indexer: (pool [B, T, P], pool_valid [B, T, P]) from the first Full layer."""
    selections: dict[int, Selection] = field(default_factory=dict)
    """Per layer: the selection it attended with."""
    scored: dict[int, int] = field(default_factory=dict)
    """Per indexing layer: entries scored per query (the indexer's search domain size)."""
    indexer_losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per indexing layer: indexer KL, a scalar."""

    def indexer_loss(self) -> torch.Tensor:
        """Mean of the per-layer indexer losses; the trainer adds `aux_loss_weight ·` this."""
        if not self.indexer_losses:
            raise RuntimeError("no indexer loss recorded: set compute_indexer_loss=True before the forward")
        return torch.stack(list(self.indexer_losses.values())).mean()


@dataclass
class CSA2LayerCache:
    """One layer's decode state for a batch of sequences advancing in lockstep (B = 1: one sequence)."""

    length: int
    """Tokens this layer has consumed (the next token's position)."""
    swa_k: torch.Tensor
    """[B, <= window-1, KVH, D] the layer's own most recent raw SWA keys (after RoPE), in the SWA format's
    storage (compute dtype unquantised; FP8 bytes when the KV cache is quantised)."""
    swa_v: torch.Tensor
    """[B, <= window-1, KVH, D] and values."""
    entries_k: torch.Tensor | None = None
    """Full layers: [B, N, KVH, D] compressed main K (after RoPE) in the main format's storage
    ([B, N, KVH, D/2] uint8 for fp4); None for Reindex / Reuse."""
    entries_v: torch.Tensor | None = None
    """Full layers: [B, N, KVH, D] compressed main V."""
    swa_k_scale: torch.Tensor | None = None
    """Quantised SWA format: scales of swa_k (`model.kv_cache` layouts); None unquantised."""
    swa_v_scale: torch.Tensor | None = None
    entries_k_scale: torch.Tensor | None = None
    """Quantised main format: scales of entries_k; None unquantised."""
    entries_v_scale: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    """Full layers: [B, N, DI] indexer K (after RoPE)."""
    pending: torch.Tensor | None = None
    """Full layers: [B, < m, KVH, 2·D] raw main K|V (before RoPE) of the unfinished group."""
    pending_gate: torch.Tensor | None = None
    """Full layers: [B, < m, KVH] their pooling logits."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor by field name (None fields left out)."""
        return {f: t for f in CACHE_FIELDS if (t := getattr(self, f)) is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


CACHE_FIELDS = ("swa_k", "swa_v", "swa_k_scale", "swa_v_scale", "entries_k", "entries_v", "entries_k_scale",
                "entries_v_scale", "index_k", "pending", "pending_gate")


@dataclass
class CSA2Cache:
    """Per-sequence (or lockstep batch) CSA2 cache: layer index -> `CSA2LayerCache`, filled on first use.

    Bytes per token, asymptotically: Σ over Full layers of (2·KVH·row_bytes(D) + DI·elem_bytes) / m
    (`bytes_per_token`); Reindex and Reuse layers add nothing per token. Every layer also holds a
    constant (window-1)-row SWA window and a Full layer at most m-1 pending raw tokens."""

    layers: dict[int, CSA2LayerCache] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length if self.layers else 0

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers.values())

    # -- persistence and lockstep batching (the engine's per-sequence caches) ---------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat named tensors `"{layer}.{field}"` (a RolloutState carries them as raw bytes)."""
        return {f"{i}.{f}": t for i, lc in self.layers.items() for f, t in lc.tensors().items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], length: int, device: str | torch.device = "cpu") -> "CSA2Cache":
        cache = cls()
        for name, t in tensors.items():
            i, f = name.split(".", 1)
            if f not in CACHE_FIELDS:
                raise ValueError(f"unknown CSA2 cache field {name!r}")
            lc = cache.layers.setdefault(int(i), CSA2LayerCache(length, None, None))
            setattr(lc, f, t.to(device))
        cache.layers = dict(sorted(cache.layers.items()))
        return cache

    @classmethod
    def stack(cls, caches: list["CSA2Cache"]) -> "CSA2Cache":
        """Sequences of equal length -> one lockstep batch (concatenated along B)."""
        if len({c.length for c in caches}) != 1:
            raise ValueError(f"only caches of equal length advance in lockstep: {[c.length for c in caches]}")
        out = cls()
        for i, lc in caches[0].layers.items():
            st = CSA2LayerCache(lc.length, None, None)
            for f in lc.tensors():
                setattr(st, f, torch.cat([getattr(c.layers[i], f) for c in caches], 0))
            out.layers[i] = st
        return out

    def split(self) -> list["CSA2Cache"]:
        """Inverse of `stack`: one B=1 cache per batch row."""
        B = next(iter(self.layers.values())).swa_k.shape[0]
        outs = [CSA2Cache() for _ in range(B)]
        for i, lc in self.layers.items():
            for b in range(B):
                one = CSA2LayerCache(lc.length, None, None)
                for f, t in lc.tensors().items():
                    setattr(one, f, t[b : b + 1])
                outs[b].layers[i] = one
        return outs


def bytes_per_token(model_cfg: ModelConfig, elem_bytes: int) -> float:
    """Asymptotic CSA2 cache growth per token over all layers (seed §2.3, §2.4.4): each Full layer adds
    one main entry (K and V rows of KVH heads in the main KV format) plus one indexer K row (DI values in
    the compute dtype) per m tokens: Σ_Full (2·KVH·row_bytes(D) + DI·elem_bytes) / m."""
    sc = model_cfg.sparse_attention
    fmt = kv_format(model_cfg.kv_cache.dtype)
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[elem_bytes]
    per_entry = 2 * model_cfg.num_kv_heads * fmt.bytes_per_row(model_cfg.head_dim, dtype) + sc.index_dim * elem_bytes
    n_full = sum(sc.mode_of(i) == "full" for i in range(model_cfg.num_layers))
    return n_full * per_entry / sc.compress_ratio


def _extend(fmt: KVFormat, data: torch.Tensor, scale: torch.Tensor | None, new: torch.Tensor,
            keep_last: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cache mode: append rows new [B, T, KVH, D] to stored (data, scale) in `fmt` along dim 1.
    -> (every row dequantised [B, S + T, KVH, D], stored data, stored scale), the stored ones trimmed to
    the last `keep_last` rows. Quantised formats store the bytes of `new` once, so what later steps read
    back is exactly what this step attends over."""
    if not fmt.quantised:
        rows = torch.cat([data, new], 1)
        kept = rows if keep_last is None else rows[:, rows.shape[1] - min(keep_last, rows.shape[1]) :]
        return rows, kept.detach(), None
    q, sc = fmt.encode(new.detach())
    data, scale = torch.cat([data, q], 1), torch.cat([scale, sc], 1)
    rows = fmt.decode(data, scale, new.dtype)
    if keep_last is not None:
        keep = data.shape[1] - min(keep_last, data.shape[1])
        data, scale = data[:, keep:], scale[:, keep:]
    return rows, data, scale


# ---------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------


class CSA2Attention(nn.Module):
    """One CSA2 attention layer; its mode (Full / Reindex / Reuse) is static, from `cfg.mode_of(layer_idx)`.

    forward(x [B, T, hidden], shared, cache=None) -> [B, T, hidden]
      training:       cache=None; positions 0..T-1, causal.
      prefill/decode: cache=CSA2Cache(); positions continue from the cache; T = 1 is a decode step.
    Parameter names starting with `index_` belong to the indexer (`indexer_parameters`)."""

    def __init__(self, model_cfg: ModelConfig, cfg: SparseAttentionConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx, self.mode = cfg, layer_idx, cfg.mode_of(layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim
        self.rope_theta = model_cfg.rope_theta
        # seed §2.4.4: main KV in the configured format; a quantised cache keeps the SWA KV in FP8
        self.main_format = kv_format(model_cfg.kv_cache.dtype)
        self.swa_format = kv_format("fp8") if self.main_format.quantised else self.main_format
        self.qat = model_cfg.kv_cache.qat
        d, kv = model_cfg.hidden_size, model_cfg.num_kv_heads * model_cfg.head_dim
        self.q_proj = nn.Linear(d, model_cfg.num_heads * model_cfg.head_dim, bias=False)
        self.swa_kv_proj = nn.Linear(d, 2 * kv, bias=False)
        self.o_proj = nn.Linear(model_cfg.num_heads * model_cfg.head_dim, d, bias=False)
        if self.mode == "full":
            self.kv_proj = nn.Linear(d, 2 * kv, bias=False)
            self.compress_gate = nn.Linear(d, model_cfg.num_kv_heads, bias=False)
            self.index_k_proj = nn.Linear(2 * kv, cfg.index_dim, bias=False)
        if self.mode != "reuse":
            self.index_q_proj = nn.Linear(d, cfg.index_heads * cfg.index_dim, bias=False)
            self.index_w_proj = nn.Linear(d, cfg.index_heads, bias=False)

    def indexer_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.startswith("index_")]

    @property
    def hierarchical(self) -> bool:
        h = self.cfg.hierarchical
        return h is not None and self.layer_idx >= h.from_layer

    # -- pieces ---------------------------------------------------------------------------------------

    def _layer_cache(self, cache: CSA2Cache, x: torch.Tensor) -> CSA2LayerCache:
        if self.layer_idx not in cache.layers:
            B, KVH, D = x.shape[0], self.num_kv_heads, self.head_dim
            empty = lambda *s, dtype=x.dtype: x.new_zeros(B, 0, *s, dtype=dtype)  # noqa: E731

            def stored(fmt):  # (data, scale) of an empty row store in fmt
                data = empty(KVH, *fmt.data_shape(D), dtype=fmt.storage_dtype(x.dtype))
                sc = fmt.scale_shape(D)
                return data, None if sc is None else empty(KVH, *sc, dtype=torch.uint8)

            (swa_k, swa_k_scale), (swa_v, swa_v_scale) = stored(self.swa_format), stored(self.swa_format)
            lc = CSA2LayerCache(0, swa_k, swa_v, swa_k_scale=swa_k_scale, swa_v_scale=swa_v_scale)
            if self.mode == "full":
                (lc.entries_k, lc.entries_k_scale), (lc.entries_v, lc.entries_v_scale) = stored(self.main_format), stored(self.main_format)
                lc.index_k = empty(self.cfg.index_dim)
                lc.pending, lc.pending_gate = empty(KVH, 2 * D), empty(KVH)
            cache.layers[self.layer_idx] = lc
        return cache.layers[self.layer_idx]

    def _main_kv(self, x: torch.Tensor, shared: SharedState, lc: CSA2LayerCache | None, start: int) -> None:
        """Full mode: project raw main KV, compress complete groups, project indexer K; publish to shared."""
        B, T, _ = x.shape
        KVH, D, m = self.num_kv_heads, self.head_dim, self.cfg.compress_ratio
        raw = self.kv_proj(x).view(B, T, KVH, 2 * D)
        gate = self.compress_gate(x)
        n_old = 0
        if lc is not None:
            raw, gate = torch.cat([lc.pending, raw], 1), torch.cat([lc.pending_gate, gate], 1)
            n_old = lc.index_k.shape[1]
            assert n_old * m + raw.shape[1] == start + T, "cache pending/entries out of step"
        entries = compress(raw, gate, m)  # [B, n_new, KVH, 2D]
        n_new = entries.shape[1]
        pos = (torch.arange(n_old, n_old + n_new, device=x.device) + 1) * m - 1  # group's last position
        k_new = rope(entries[..., :D], pos, self.rope_theta)
        v_new = entries[..., D:]
        # Indexer K from the main KV entries (seed §2.3), detached: only the indexer loss trains it.
        ik_new = self.index_k_proj(entries.detach().flatten(-2)).unsqueeze(2)
        ik_new = rope(ik_new, pos, self.rope_theta).squeeze(2)
        if lc is not None:
            lc.pending, lc.pending_gate = raw[:, n_new * m :].detach(), gate[:, n_new * m :].detach()
            k_new, lc.entries_k, lc.entries_k_scale = _extend(self.main_format, lc.entries_k, lc.entries_k_scale, k_new.detach())
            v_new, lc.entries_v, lc.entries_v_scale = _extend(self.main_format, lc.entries_v, lc.entries_v_scale, v_new.detach())
            lc.index_k = torch.cat([lc.index_k, ik_new.detach()], 1)
            ik_new = lc.index_k
        elif self.qat:  # seed §2.4.4 QAT: the cache's round trip after RoPE, straight-through gradient
            k_new, v_new = fake_quant(k_new, self.main_format), fake_quant(v_new, self.main_format)
        shared.main_k, shared.main_v, shared.index_k, shared.source_layer = k_new, v_new, ik_new, self.layer_idx
        shared.topk = None

    def index(self, x: torch.Tensor, shared: SharedState, positions: torch.Tensor) -> tuple[Selection, torch.Tensor]:
        """Full / Reindex: score candidates with this layer's indexer Q, pick top-k.
        -> (selection, scores of the picks [B, T, topk], differentiable in the indexer parameters only)."""
        B, T, _ = x.shape
        HI, DI = self.cfg.index_heads, self.cfg.index_dim
        xd = x.detach()
        q_index = rope(self.index_q_proj(xd).view(B, T, HI, DI), positions, self.rope_theta) * DI**-0.5
        w_index = self.index_w_proj(xd) * HI**-0.5
        n_visible = (positions + 1) // self.cfg.compress_ratio
        k_index = shared.index_k
        pool = shared.candidate_pool if (self.mode == "reindex" and self.hierarchical) else None
        if pool is not None:  # seed §2.3.2: a later Reindex layer scores only the candidate pool
            ids, ok = pool
            scores = pool_index_scores(q_index, w_index, k_index, ids, ok)
        else:
            ids = None
            scores = index_scores(q_index, w_index, k_index)
            scores = scores.masked_fill(~visible_mask(n_visible, scores.shape[-1]), NEG_INF)
            if self.mode == "full" and self.hierarchical and shared.candidate_pool is None:
                h = self.cfg.hierarchical
                shared.candidate_pool = build_candidate_pool(scores, n_visible, h.block_size, h.num_blocks)
        shared.scored[self.layer_idx] = scores.shape[-1]
        sel = select_topk(scores, self.cfg.topk, ids)
        picked = F.pad(scores, (0, max(0, self.cfg.topk - scores.shape[-1])), value=NEG_INF).gather(-1, sel.order)
        return sel, picked

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, shared: SharedState, cache: CSA2Cache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, KVH, D, W = self.num_heads, self.num_kv_heads, self.head_dim, self.cfg.window
        lc = None if cache is None else self._layer_cache(cache, x)
        start = 0 if lc is None else lc.length
        if lc is not None:
            lc.length = start + T
        positions = torch.arange(start, start + T, device=x.device)

        q = rope(self.q_proj(x).view(B, T, H, D), positions, self.rope_theta)
        swa = self.swa_kv_proj(x).view(B, T, KVH, 2 * D)
        swa_k, swa_v = rope(swa[..., :D], positions, self.rope_theta), swa[..., D:]
        if lc is not None:
            swa_k, lc.swa_k, lc.swa_k_scale = _extend(self.swa_format, lc.swa_k, lc.swa_k_scale, swa_k, W - 1)
            swa_v, lc.swa_v, lc.swa_v_scale = _extend(self.swa_format, lc.swa_v, lc.swa_v_scale, swa_v, W - 1)
        elif self.qat:
            swa_k, swa_v = fake_quant(swa_k, self.swa_format), fake_quant(swa_v, self.swa_format)
        win_k, win_valid = _windows(swa_k, T, W)
        win_v, _ = _windows(swa_v, T, W)

        if self.mode == "full":
            self._main_kv(x, shared, lc, start)
        elif shared.main_k is None:
            raise RuntimeError(f"layer {self.layer_idx} ({self.mode}) runs before any Full layer in this forward")
        if self.mode == "reuse":
            if shared.topk is None:
                raise RuntimeError(f"layer {self.layer_idx} (reuse) has no top-k against layer {shared.source_layer}'s main KV")
            sel, picked = shared.topk, None
        else:
            sel, picked = self.index(x, shared, positions)
            shared.topk = sel
        shared.selections[self.layer_idx] = sel

        # Attention over the union: selected compressed entries + the layer's own window.
        keys = torch.cat([_gather_per_query(shared.main_k, sel.ids), win_k], 2)  # [B, T, K+W, KVH, D]
        vals = torch.cat([_gather_per_query(shared.main_v, sel.ids), win_v], 2)
        mask = torch.cat([sel.valid, win_valid.expand(B, T, W)], -1)  # [B, T, K+W]
        G, ct = H // KVH, _compute_dtype(x.dtype)
        logits = torch.einsum("btkgd,btskd->btkgs", q.view(B, T, KVH, G, D), keys).to(ct) * D**-0.5
        probs = logits.masked_fill(~mask[:, :, None, None, :], NEG_INF).softmax(-1)
        out = torch.einsum("btkgs,btskd->btkgd", probs.to(vals.dtype), vals).reshape(B, T, H * D)

        if shared.compute_indexer_loss and picked is not None:
            shared.indexer_losses[self.layer_idx] = indexer_kl(probs[..., : sel.ids.shape[-1]], picked, sel.valid,
                                                               shared.query_mask)
        return self.o_proj(out)


def indexer_kl(main_probs: torch.Tensor, picked_scores: torch.Tensor, valid: torch.Tensor,
               query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """main_probs [B, T, KVH, G, K] main attention probabilities on the selected entries; picked_scores
    [B, T, K] the indexer scores of those entries; valid [B, T, K]; query_mask [B, T] bool (queries that
    count: padding positions of a right-padded batch do not) or None -> scalar.

    seed §3.1.2 / DeepSeek-V3.2 indexer training: p = Σ_heads main attention on the selected entries,
    renormalised and detached; loss = mean over queries of KL(p || softmax(I(t, ·))) over the same
    entries. Gradient reaches only the indexer scores."""
    p = main_probs.detach().sum(dim=(2, 3))
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    finite_min = torch.finfo(picked_scores.dtype).min  # not -inf: an all-invalid row must not give nan grads
    log_q = picked_scores.masked_fill(~valid, finite_min).log_softmax(-1)
    kl = torch.where(valid, torch.xlogy(p, p) - p * log_q, 0.0).sum(-1)
    rows = valid.any(-1)
    if query_mask is not None:
        rows = rows & query_mask.to(device=rows.device, dtype=torch.bool)
    return (kl * rows).sum() / rows.sum().clamp_min(1)

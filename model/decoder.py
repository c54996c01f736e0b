"""One configurable decoder: dense (Llama / Qwen3) or MoE (Qwen3-MoE / DeepSeekMoE) FFN.

Parameter names follow the Hugging Face Llama/Qwen3 layout (`model.layers.{i}.self_attn.q_proj.weight`,
`...mlp.gate_proj.weight`, `model.norm.weight`, `lm_head.weight`) so that checkpoints map by name.
One departure: routed experts are stored stacked, `mlp.experts.{gate,up,down}_proj` of shape
[num_experts, out, in]; an HF checkpoint's per-expert `mlp.experts.{j}.gate_proj.weight` maps onto row j.

The same forward serves training (dense causal attention over a right-padded batch) and the engine
(a paged KV cache, see `model.kv_cache`). With `sparse_attention` set every layer's attention is a
CSA2 layer (`model.sparse_attention`, seed §2.3): one `SharedState` per forward carries main KV,
indexer K and top-k from layer to layer, and the engine passes a per-sequence `CSA2Cache` instead of a
paged batch. MoE layers return the expert ids they chose for every token
and accept recorded ids back (routing replay): with replay, the gate weights still come from the
current router's scores gathered at the replayed ids, so the router keeps its gradient.

The engine's no-grad forward may take a fused rollout path instead (`enable_rollout_fusion`, model/fused.py:
concatenated q/k/v and gate/up weights, fused kernels), with the same arithmetic; training never does.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from model import compile as train_compile
from model import fused
from model.eager_ops import rms_norm_eager, rope_eager  # noqa: F401  (the kernels' references, used here)
from model.config import ModelConfig, MoEFFNConfig, RopeScalingConfig
from model.kv_cache import PagedBatch, fake_quant, kv_format
from model.sparse_attention import CSA2Attention, CSA2Cache, SharedState
from model import varlen
from model.varlen import PackedSequences, varlen_attention


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (FSDP2's shards, rl/train/parallel.py), without importing torch.distributed.tensor
    (about a second of start-up) in a process that has not: no tensor can be a DTensor before that module is."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.compile_backend: str | None = None
        """The training forward's norm under torch.compile with this backend (model/compile.py "ops"); None: eager."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.is_grad_enabled():  # rollout / evaluation: one fused kernel
            from model.kernels import norm_rope

            if norm_rope.ENABLED:
                return norm_rope.rms_norm(x, self.weight, self.eps)
        if self.compile_backend is not None and torch.is_grad_enabled():
            return train_compile.compiled(rms_norm_eager, self.compile_backend)(x, self.weight, self.eps)
        return rms_norm_eager(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x): the rollout path's residual add and norm, one kernel on CUDA
        (model/fused.py); the plain forward's two operations elsewhere."""
        if fused.use_kernels(x):
            from model.kernels import decode_fused

            return decode_fused.add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalingConfig | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32: theta^(-2i/D), then the checkpoint's scaling, computed
    with the same float32 operations as transformers (`modeling_rope_utils`), so logits agree to rounding.

    linear: every frequency / factor. llama3 (Llama 3.1): with wavelength λ = 2π/f and L = the original
    context, λ > L/low_freq_factor -> f/factor; λ < L/high_freq_factor -> f; between, the interpolation
    (1 - s)·f/factor + s·f with s = (L/λ - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, 1, head_dim] (rotate-half convention, as HF Llama)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]."""
    if x.is_cuda and not torch.is_grad_enabled():  # rollout / evaluation: one fused kernel
        from model.kernels import norm_rope

        if norm_rope.ENABLED:
            return norm_rope.rope(x, cos, sin)
    return rope_eager(x, cos, sin)


class Attention(nn.Module):
    """GQA attention with optional qk-norm. K/V are written to the paged cache after RoPE.

    With a quantised KV cache (`kv_cache.dtype` fp8 / fp4, seed §2.4.4) every path attends over the
    dequantised K/V: decode reads them back from the cache, prefill uses what the cache write returns,
    and the training forward with `kv_cache.qat` applies the same round trip (`fake_quant`, straight-
    through gradient), so training, prefill and decode see bit-identical K/V."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qat_format = kv_format(cfg.kv_cache.dtype) if cfg.kv_cache.qat else None
        self.rollout_weights: fused.FusedWeights | None = None
        """q/k/v concatenated for the rollout path (`Decoder.enable_rollout_fusion`); None: off."""
        self.compile_backend: str | None = None
        """The training forward's RoPE under torch.compile with this backend (model/compile.py "ops"); None: eager."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.compile_backend is not None and torch.is_grad_enabled():
            rope = train_compile.compiled(rope_eager, self.compile_backend)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self._attend(q, k, v, batch)

    def forward_rollout(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None
                        ) -> torch.Tensor:
        """The rollout path (model/fused.py): q/k/v from one GEMM over the fused weights, then qk-norm, RoPE
        and, with a bf16-format cache, the K/V write in one kernel; attention as in `forward` after that."""
        fw = self.rollout_weights
        qkv = fused.linear(x, fw.weight, fw.bias)  # [B, T, (H + 2·KVH)·D]
        norm_w = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        if not fused.use_kernels(qkv):
            q, k, v = fused.qkv_norm_rope_eager(qkv, cos, sin, self.num_heads, self.num_kv_heads, *norm_w, eps)
            return self._attend(q, k, v, batch)
        from model.kernels import decode_fused

        pools = None if batch is None else batch.cache.unquantised_layer(self.layer_idx)
        if pools is None and batch is not None and batch.block_table is not None and decode_fused.fp4_write_ok(self.head_dim):
            pools = batch.cache.fp4_layer(self.layer_idx)  # paged decode: fp4 rows encoded in the same kernel
        cache = None if pools is None else (pools[0], pools[1], batch.slot_mapping, pools[2])
        q, k, v = decode_fused.qkv_norm_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, *norm_w, eps, cache)
        return self._attend(q, k, v, batch, written=cache is not None)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch | PackedSequences | None,
                written: bool = False) -> torch.Tensor:
        """q [B, T, H, D], k, v [B, T, KVH, D] (after RoPE) -> o_proj(attention) [B, T, hidden], writing K/V to
        the paged cache unless `written` (the rollout path's kernel has put them there, bf16 format). `batch`: the
        engine's paged batch, a packed training forward's rows (model/varlen.py: B = 1, a document mask), or None."""
        B, T = q.shape[:2]
        gqa = self.num_heads != self.num_kv_heads
        if isinstance(batch, PackedSequences):
            if self.qat_format is not None:
                k, v = fake_quant(k, self.qat_format), fake_quant(v, self.qat_format)
            out = varlen_attention(q, k, v, batch)  # [1, N, H, D]
            return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))
        if batch is None or batch.is_prefill:
            # Training and prefill: causal attention over the (right-padded) tokens themselves.
            if batch is not None and not written:
                k, v = batch.cache.write(self.layer_idx, batch.slot_mapping, k, v)
            elif batch is None and self.qat_format is not None:
                k, v = fake_quant(k, self.qat_format), fake_quant(v, self.qat_format)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
            )
        elif batch.block_table is not None:
            # Decode through the paged kernel: the cache is read in its storage format, nothing gathered.
            if not written:
                batch.cache.write(self.layer_idx, batch.slot_mapping, k, v, read_back=False)
            out = batch.cache.attend(self.layer_idx, q[:, 0], batch.block_table, batch.context_lens)  # [B, H, D]
            return fused.linear(out.reshape(B, T, self.num_heads * self.head_dim), self.o_proj.weight)
        else:
            # Decode: write this step's K/V, then attend over the sequence's cached context.
            if not written:
                batch.cache.write(self.layer_idx, batch.slot_mapping, k, v, read_back=False)
            k_ctx, v_ctx = batch.cache.gather(self.layer_idx, batch.context_slots)  # [B, S, KVH, D]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                attn_mask=batch.context_mask, enable_gqa=gqa,
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.rollout_weights: fused.FusedWeights | None = None
        """gate/up concatenated for the rollout path (`Decoder.enable_rollout_fusion`); None: off."""
        self.compile_backend: str | None = None
        """The training forward's SiLU·up under torch.compile with this backend (model/compile.py "ops"); None: eager."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compile_backend is not None and torch.is_grad_enabled():
            return self.down_proj(train_compile.compiled(train_compile.silu_mul, self.compile_backend)(
                self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_rollout(self, x: torch.Tensor) -> torch.Tensor:
        """The rollout path (model/fused.py): gate and up as one GEMM, silu(gate)·up as one kernel."""
        gate_up = fused.linear(x, self.rollout_weights.weight)
        if fused.use_kernels(gate_up):
            from model.kernels import decode_fused

            return fused.linear(decode_fused.silu_mul(gate_up), self.down_proj.weight)
        return self.down_proj(fused.silu_mul_eager(gate_up))


class Router(nn.Module):
    """Token-to-expert scores; `e_score_correction_bias` is DeepSeek's aux-loss-free balancing bias.
    The bias only shifts which experts are selected, never the gate weights."""

    def __init__(self, d: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).float().softmax(dim=-1)


class ExpertBank(nn.Module):
    """Routed experts' SwiGLU weights, stacked along the expert dimension."""

    def __init__(self, num_experts: int, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, f, d))
        self.up_proj = nn.Parameter(torch.empty(num_experts, f, d))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d, f))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, d]; expert_ids, weights [N, k] -> Σ_j weights[:, j] · expert_{ids[:, j]}(x). Without autograd
        on the kernels' device (the rollout path), with `fused.GROUPED_EXPERTS`, the grouped Triton kernels of
        model/kernels/moe.py run it: no loop over experts and no host read; else `loop`."""
        if fused.GROUPED_EXPERTS and fused.use_kernels(x) and not torch.is_grad_enabled():
            from model.kernels.moe import moe_experts

            return moe_experts(x, expert_ids, weights, self.gate_proj, self.up_proj, self.down_proj)
        return self.loop(x, expert_ids, weights)

    def loop(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference: one GEMM pair per expert that has tokens (reads the counts on the host), with autograd."""
        N, k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k
        counts = torch.bincount(flat_ids, minlength=self.gate_proj.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = token_of[start : start + n]
            xe = x.index_select(0, idx)
            h = F.silu(xe @ self.gate_proj[e].t()) * (xe @ self.up_proj[e].t())
            ye = (h @ self.down_proj[e].t()) * weights.reshape(-1)[order[start : start + n]].unsqueeze(-1).to(x.dtype)
            out.index_add_(0, idx, ye)
            start += n
        return out


class MoE(nn.Module):
    def __init__(self, d: int, cfg: MoEFFNConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Router(d, cfg.num_experts)
        self.experts = ExpertBank(cfg.num_experts, d, cfg.moe_intermediate_size)
        self.shared_experts = (
            SwiGLU(d, cfg.moe_intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d], replay_ids [N, k] or None -> (y [N, d], chosen expert ids [N, k])."""
        scores = self.gate(x)  # [N, E] float32
        if replay_ids is None:
            ids = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1).indices
        else:
            ids = replay_ids.long()
        weights = scores.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        y = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y, ids


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_sparse = cfg.is_sparse
        self.self_attn = CSA2Attention(cfg, cfg.sparse_attention, layer_idx) if cfg.is_sparse else Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe
        self.mlp = MoE(cfg.hidden_size, cfg.ffn) if cfg.is_moe else SwiGLU(cfg.hidden_size, cfg.ffn.intermediate_size)

    def forward(self, h, cos, sin, batch, replay_ids, shared=None, csa2_cache=None):
        x = self.input_layernorm(h)
        h = h + (self.self_attn(x, shared, csa2_cache) if self.is_sparse else self.self_attn(x, cos, sin, batch))
        x = self.post_attention_layernorm(h)
        if not self.is_moe:
            return h + self.mlp(x), None
        B, T, d = x.shape
        y, ids = self.mlp(x.reshape(B * T, d), None if replay_ids is None else replay_ids.reshape(B * T, -1))
        return h + y.view(B, T, d), ids.view(B, T, -1)

    def forward_rollout(self, h, y, cos, sin, batch, replay_ids):
        """`forward` on the rollout path (model/fused.py) with the residual stream handed over as h + y, y (the
        previous layer's FFN output, None before the first layer) not yet added, so that each residual add is
        one kernel with the RMSNorm after it. -> (h, y, expert ids or None), this layer's FFN output y unadded:
        the same additions in the same order as `forward`."""
        if y is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_forward(y, h)
        x, h = self.post_attention_layernorm.add_forward(self.self_attn.forward_rollout(x, cos, sin, batch), h)
        if not self.is_moe:
            return h, self.mlp.forward_rollout(x), None
        B, T, d = x.shape
        y, ids = self.mlp(x.reshape(B * T, d), None if replay_ids is None else replay_ids.reshape(B * T, -1))
        return h, y.view(B, T, d), ids.view(B, T, -1)


class DecoderBody(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class DecoderOutput:
    hidden: torch.Tensor
    """Final normed hidden states [B, T, hidden]."""
    routing: torch.Tensor | None
    """MoE: expert ids chosen (or replayed) [B, T, num_layers, top_k] int64; None for dense."""
    indexer_loss: torch.Tensor | None = None
    """CSA2 with compute_indexer_loss: mean indexer KL over indexing layers (seed §3.1.2), a scalar."""


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self._rollout: fused.RolloutFusion | None = None
        """The rollout path's fused weights (`enable_rollout_fusion`); None: off."""
        self._compiled_layers: list | None = None
        """The training forward's layers under torch.compile (`compile_for_training("layers")`); None: eager."""
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.is_meta:  # a shape-only model (rl/runtime/memory.py counts its parameters): no values to draw
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("proj.bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        batch: PagedBatch | None = None,
        routing_replay: torch.Tensor | None = None,
        checkpoint_layers: bool = False,
        csa2_cache: CSA2Cache | None = None,
        compute_indexer_loss: bool = False,
        indexer_query_mask: torch.Tensor | None = None,
        packed: PackedSequences | None = None,
    ) -> DecoderOutput:
        """input_ids, positions [B, T]; routing_replay [B, T, num_layers, top_k] or None.

        packed: input_ids [1, N] holds several rows back to back (model/varlen.py), attended with a document mask;
        positions must restart at every row (`PackedSequences.positions`). Training only (no paged batch), dense
        attention only: a CSA2 layer's compressed entries and indexer span the whole sequence, so CSA2 trains padded.

        checkpoint_layers: recompute each layer in the backward pass (training only). A layer's
        replayed expert ids are an argument of that layer, so the recomputation reuses exactly the
        record the first pass used; nothing is consumed twice. Not for CSA2: its layers hand state
        to each other through the forward's SharedState, which a recomputation would see changed, so
        sparse models run without layer recomputation.

        CSA2 (`config.sparse_attention`): positions are implicit (0..T-1, or continuing from
        `csa2_cache`, whose B sequences advance in lockstep: equal lengths, no padding); `batch` must be
        None. compute_indexer_loss: fill `DecoderOutput.indexer_loss` (training), averaged over the queries
        of `indexer_query_mask` [B, T] bool (a right-padded batch's real tokens; None: every query).
        """
        sparse = self.config.is_sparse
        if sparse and (batch is not None or positions is not None):
            raise ValueError("a CSA2 model takes csa2_cache (positions continue from it), not a paged batch or positions")
        if not sparse and (csa2_cache is not None or compute_indexer_loss):
            raise ValueError("csa2_cache / compute_indexer_loss need config.sparse_attention")
        if packed is not None and (sparse or batch is not None or positions is None or input_ids.shape[0] != 1):
            raise ValueError("a packed forward is one row of dense attention with its positions, and no paged batch")
        cos = sin = shared = None
        if sparse:
            shared = SharedState(compute_indexer_loss=compute_indexer_loss, query_mask=indexer_query_mask)
        else:
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)
        if self._rollout is not None and fused.ENABLED and not sparse and not torch.is_grad_enabled() and packed is None:
            self._rollout.refresh()  # a check of version counters; copies only after an in-place weight update
            return self._forward_rollout(self.model.embed_tokens(input_ids), cos, sin, batch, routing_replay)
        h = self.model.embed_tokens(input_ids)
        routing = []
        recompute = checkpoint_layers and batch is None and not sparse and torch.is_grad_enabled()
        compiled = self._compiled_layers if batch is None and torch.is_grad_enabled() else None
        if compiled is not None and not h.requires_grad:
            # A frozen embedding (LoRA) gives layer 0 an input without grad and every later layer one with it: two
            # graphs, compiled twice, forward and backward. Asking for the input's gradient keeps it one graph (the
            # first step's compile halves) for one layer's input-gradient matmuls a step.
            h = h.requires_grad_()
        for i, layer in enumerate(self.model.layers):
            replay_i = None if routing_replay is None else routing_replay[:, :, i]
            if compiled is not None and compiled[i] is not None:
                layer = compiled[i]
            if recompute:
                h, ids = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, packed, replay_i, use_reentrant=False)
            else:
                h, ids = layer(h, cos, sin, packed if packed is not None else batch, replay_i, shared, csa2_cache)
            if ids is not None:
                routing.append(ids)
        return DecoderOutput(self.model.norm(h), torch.stack(routing, dim=2) if routing else None,
                             shared.indexer_loss() if compute_indexer_loss else None)

    def _forward_rollout(self, h, cos, sin, batch, routing_replay) -> DecoderOutput:
        """The no-grad rollout path (model/fused.py): each layer hands its FFN output to the next one unadded
        (`DecoderLayer.forward_rollout`), so every residual add is one kernel with the RMSNorm that follows."""
        y, routing = None, []
        for i, layer in enumerate(self.model.layers):
            replay_i = None if routing_replay is None else routing_replay[:, :, i]
            h, y, ids = layer.forward_rollout(h, y, cos, sin, batch, replay_i)
            if ids is not None:
                routing.append(ids)
        hidden, _ = self.model.norm.add_forward(y, h)
        return DecoderOutput(hidden, torch.stack(routing, dim=2) if routing else None)

    def compile_for_training(self, mode: str | None, backend: str = "inductor") -> None:
        """Run the training forward (grad enabled, no paged batch) under torch.compile (model/compile.py): "layers"
        compiles each dense, non-CSA2 decoder layer whole (MoE and CSA2 layers, whose dispatch is data-dependent,
        take "ops" instead); "ops" compiles the norms, RoPE and SiLU·up only; None: eager. Parameters and the
        state dict are untouched, so checkpoints, FSDP and the rollout copy do not see it. `backend`: torch.compile's
        ("aot_eager" traces and runs autograd's graphs without code generation: the CPU tests)."""
        if mode is not None and mode not in train_compile.MODES:
            raise ValueError(f"compile mode {mode!r}: expected one of {train_compile.MODES} or None")
        whole = [mode == "layers" and not layer.is_moe and not layer.is_sparse for layer in self.model.layers]
        self._compiled_layers = None
        if mode is not None:
            varlen.prepare_for_compile()
        if any(whole):
            self._compiled_layers = [torch.compile(layer, dynamic=True, backend=backend) if w else None
                                     for layer, w in zip(self.model.layers, whole)]
        for layer, w in zip(self.model.layers, whole):
            ops = backend if mode is not None and not w else None
            for m in layer.modules():
                if isinstance(m, (RMSNorm, Attention, SwiGLU)):
                    m.compile_backend = ops
        self.model.norm.compile_backend = backend if mode is not None else None

    # -- rollout fusion (model/fused.py) -----------------------------------------------------------------
    def enable_rollout_fusion(self, share_storage: bool = False) -> bool:
        """Turn on the rollout path (model/fused.py): q/k/v and gate/up weights concatenated, used by every
        no-grad forward from now on (training, with autograd, never uses them). share_storage: the Linears'
        weights become views of the concatenated buffers (for a copy nobody trains: no second copy of the
        weights, in-place updates need no refresh); else they stay as they are and the buffers are copies,
        refreshed in place when the weights change. Returns whether the path is on (never for CSA2 models;
        calling again keeps the first mode)."""
        if self.config.is_sparse:
            return False
        if self._rollout is not None:
            return True
        if any(is_dtensor(p) for p in self.parameters()):
            raise ValueError("rollout fusion needs full weights: enable it on the engine's copy, not on FSDP2 shards")
        groups = []
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.rollout_weights = fused.FusedWeights([attn.q_proj, attn.k_proj, attn.v_proj], share_storage)
            groups.append(attn.rollout_weights)
            if not layer.is_moe:
                mlp = layer.mlp
                mlp.rollout_weights = fused.FusedWeights([mlp.gate_proj, mlp.up_proj], share_storage)
                groups.append(mlp.rollout_weights)
        self._rollout = fused.RolloutFusion(groups, share_storage)
        return True

    def refresh_rollout_weights(self) -> bool:
        """Bring the rollout path's fused weights level with the parameters (after an in-place update: the
        optimizer, a refreshed rollout copy, a checkpoint load), in place, so captured CUDA graphs stay valid.
        A cheap check when nothing changed or fusion is off; returns whether anything was copied. Every
        rollout forward and graph replay calls it first; rl/runtime/worker.py calls it right after a weight update."""
        return self._rollout is not None and self._rollout.refresh()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [B, T, hidden] -> logits [B, T, vocab] float32."""
        return self.lm_head(hidden).float()

    def forward(self, input_ids, positions=None, *, batch=None, routing_replay=None,
                checkpoint_layers: bool = False, csa2_cache: CSA2Cache | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits [B, T, vocab] float32, routing or None)."""
        out = self.forward_hidden(input_ids, positions, batch=batch, routing_replay=routing_replay,
                                  checkpoint_layers=checkpoint_layers, csa2_cache=csa2_cache)
        return self.logits(out.hidden), out.routing

    def indexer_parameters(self) -> list[nn.Parameter]:
        """CSA2 indexer parameters (trained only by the indexer loss); empty for dense attention."""
        return [p for layer in self.model.layers if layer.is_sparse for p in layer.self_attn.indexer_parameters()]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""The rollout engine: continuous batching over a paged KV cache, token-level interrupt and resume.

The engine is a plain component (no Ray); an actor shell drives it. One `step()` advances every
active sequence by exactly one token: newly admitted sequences are prefilled (which yields their first
token) and the others decode one token. Between two steps every sequence sits at a token boundary, so
`interrupt()` may be called there: each active sequence's KV slots, routing trace, logprobs and
versions move to host memory as a `RolloutState` and its blocks return to the pool. `resume(states)`
writes the KV back into fresh blocks and continues decoding with no prefill (seed §5.2.3). Finished
sequences free their blocks at once.

CSA2 models (`ModelConfig.sparse_attention`, seed §2.3): each sequence holds its own `CSA2Cache`
(compressed main KV entries, indexer K, SWA window, pending group; not paged). The block pool then has
no layers and only keeps the admission budget. Sequences whose caches have the same length advance
together as one lockstep batch (a GRPO group shares its prompt, so its members usually do); others
run in separate forwards. interrupt() exports each cache's tensors in their storage format into the
RolloutState; resume() rebuilds the cache, again with no prefill.

On CUDA, a dense model's decode step is replayed from a CUDA graph of its batch-size bucket
(rollout/graphs.py; `EngineConfig.cuda_graphs`); prefill computes logits at each last prompt position only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from model.decoder import Decoder
from model.kv_cache import CacheFullError, PagedBatch, PagedKVCache
from model.sparse_attention import CSA2Cache
from model.sparse_attention import bytes_per_token as csa2_bytes_per_token
from rollout.config import EngineConfig
from rollout.graphs import DecodeGraphs
from rollout.sampling import sample_tokens
from rollout.types import Generation, GenerationRequest, RolloutState


@dataclass(eq=False)
class _Seq:
    """Engine-internal mutable state of one admitted sequence."""

    request: GenerationRequest
    tokens: list[int]
    blocks: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[torch.Tensor] = field(default_factory=list)
    """Per forward: [num_fed_tokens, L, k] expert ids."""
    generate_s: float = 0.0
    needs_prefill: bool = True
    csa2: CSA2Cache | None = None
    """CSA2 models: this sequence's cache (B = 1)."""

    @property
    def num_cached(self) -> int:  # every token but the last sampled one has its KV in the cache
        return len(self.tokens) - 1

    @property
    def num_response(self) -> int:
        return len(self.tokens) - len(self.request.prompt_tokens)


@dataclass
class EngineStats:
    prefill_calls: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    resumed_tokens: int = 0
    """Tokens whose KV came back from a RolloutState instead of being recomputed."""
    reprefill_tokens: int = 0
    """Generated tokens that had to be prefilled again (a state that lost its KV); 0 by design."""
    prefill_seqs: int = 0
    """Sequences prefilled."""
    prefill_logit_rows: int = 0
    """Rows of logits computed at prefill: one per prefilled sequence (its last prompt position)."""
    graph_steps: int = 0
    """Decode steps replayed from a CUDA graph (rollout/graphs.py)."""
    kv_gather_bytes: int = 0
    """Bytes of K/V copied out of the paged cache (dequantised) into temporary context tensors by decode."""


class Engine:
    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_id: int, eos_ids: Sequence[int] = (),
                 device: str | torch.device = "cpu"):
        """`eos_id` and `eos_ids`: a sequence stops on any of them (a checkpoint may name several, e.g. Llama 3's
        <|eot_id|> and <|end_of_text|>); `eos_id` alone is the single-id form."""
        self.model, self.cfg, self.eos_id = model, cfg, eos_id
        self.eos_ids = frozenset((eos_id, *eos_ids))
        self.device = torch.device(device)
        mcfg = model.config
        self.sparse = mcfg.is_sparse
        self.cache = PagedKVCache(  # CSA2: no paged layers, block bookkeeping only (admission budget)
            num_layers=0 if self.sparse else mcfg.num_layers, num_blocks=cfg.pool_blocks, block_size=cfg.block_size,
            num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
            dtype=next(model.parameters()).dtype, device=self.device, kv_dtype=mcfg.kv_cache.dtype,
        )
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda" and not self.sparse and not mcfg.is_moe:
            self.graphs = DecodeGraphs(model, self.cache, cfg.max_batch_size, self.cache.blocks_for(cfg.max_seq_len),
                                       paged_kernel=cfg.paged_decode_kernel)
        self.policy_version = 0
        self.stats = EngineStats()
        self._waiting: list[RolloutState] = []
        self._active: list[_Seq] = []

    # -- public API ------------------------------------------------------------------------------
    def add(self, requests: list[GenerationRequest]) -> None:
        for r in requests:
            if len(r.prompt_tokens) + 1 > self.cfg.max_seq_len:
                raise ValueError(f"prompt of {r.sample_id} has {len(r.prompt_tokens)} tokens; max_seq_len is {self.cfg.max_seq_len}")
            self._waiting.append(RolloutState(request=r, tokens=list(r.prompt_tokens)))

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        """KV-cache bytes one token costs in one layer, K and V together (seed §2.4.4), for KVH kv heads
        of D channels: bf16 (unquantised) 2·KVH·D·elem; fp8 2·KVH·(D + 1) (E4M3 values + one E8M0
        scale per row); fp4 2·KVH·D·4.5/8 (E2M1, 4 bits, + one 8-bit E4M3 scale per 16 values).
        CSA2: `kv_bytes_per_token` / num_layers (the per-layer average of the compressed cache)."""
        if self.sparse:
            return self.kv_bytes_per_token / self.model.config.num_layers
        return self.cache.bytes_per_token_per_layer

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token over all layers. Dense: num_layers · the per-layer figure. CSA2
        (asymptotic, `model.sparse_attention.bytes_per_token`): Σ_Full (2·KVH·row_bytes(D) + DI·elem) / m;
        the constant SWA window and pending group are excluded."""
        if self.sparse:
            return csa2_bytes_per_token(self.model.config, self.cache.dtype.itemsize)
        return self.model.config.num_layers * self.cache.bytes_per_token_per_layer

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._active or self._waiting)

    def oldest_versions(self) -> list[int]:
        """Version of the oldest generated token of every unfinished sequence that has one."""
        return [s.versions[0] for s in self._active if s.versions] + [
            s.policy_versions[0] for s in self._waiting if s.policy_versions
        ]

    @torch.no_grad()
    def step(self) -> list[Generation]:
        """Advance every active sequence by one token; admit waiting ones. Returns finished ones."""
        t0 = time.perf_counter()
        old = list(self._active)
        new = self._admit()
        fresh = [s for s in new if s.needs_prefill]
        resumed = [s for s in new if not s.needs_prefill]
        logits_parts, seqs = [], []
        if fresh:
            logits_parts.append(self._forward_csa2(fresh, prefill=True) if self.sparse else self._prefill(fresh))
            seqs += fresh
        decoding = old + resumed
        if decoding:
            logits_parts.append(self._forward_csa2(decoding, prefill=False) if self.sparse else self._decode(decoding))
            seqs += decoding
        if not seqs:
            return []
        self._sample_and_append(seqs, torch.cat(logits_parts))
        dt = time.perf_counter() - t0
        finished = []
        for s in seqs:
            s.generate_s += dt
            if (s.tokens[-1] in self.eos_ids and not s.request.ignore_eos) or s.num_response >= self._max_new(s.request):
                finished.append(self._finish(s))
        return finished

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Run the given requests to completion (convenience for evaluation and tests)."""
        self.add(requests)
        out = []
        while self.has_work():
            out += self.step()
        order = {r.sample_id: i for i, r in enumerate(requests)}
        return sorted(out, key=lambda g: order.get(g.sample_id, len(order)))

    @torch.no_grad()
    def interrupt(self) -> list[RolloutState]:
        """Stop at the current token boundary: every active sequence's state moves to host memory and
        its blocks are freed; waiting requests are returned too (with no KV)."""
        states = []
        for s in self._active:
            routing = torch.cat(s.routing).to(torch.int16).cpu().numpy() if s.routing else None
            if self.sparse:
                csa2 = {n: t.to("cpu", copy=True) for n, t in s.csa2.to_tensors().items()}
                states.append(RolloutState(s.request, list(s.tokens), list(s.logprobs), list(s.versions), None, None,
                                           routing, s.generate_s, kv_format=self.cache.format.name, csa2=csa2))
            else:
                kv = self.cache.export(self.cache.slots(s.blocks, 0, s.num_cached))
                states.append(RolloutState(
                    s.request, list(s.tokens), list(s.logprobs), list(s.versions), kv["k"], kv["v"], routing,
                    s.generate_s, kv_format=self.cache.format.name, k_scale=kv.get("k_scale"), v_scale=kv.get("v_scale")))
            self.cache.free(s.blocks)
        states += self._waiting
        self._active, self._waiting = [], []
        return states

    def resume(self, states: list[RolloutState]) -> None:
        """Queue interrupted states; they rejoin at the next step with their KV restored (no prefill).
        A state whose KV is in another storage format or layout (paged vs CSA2) is refused here."""
        mine = f"{self.cache.format.name} {'CSA2' if self.sparse else 'paged'}"
        for st in states:
            theirs = f"{st.kv_format} {'CSA2' if st.csa2 is not None else 'paged'}"
            if st.has_kv and theirs != mine:
                raise ValueError(f"{st.request.sample_id}: state holds a {theirs} KV cache; this engine stores {mine}")
        self._waiting.extend(states)

    # -- internals -------------------------------------------------------------------------------
    def _max_new(self, r: GenerationRequest) -> int:
        return min(r.max_new_tokens, self.cfg.max_seq_len - len(r.prompt_tokens))

    def _admit(self) -> list[_Seq]:
        admitted = []
        while self._waiting and len(self._active) < self.cfg.max_batch_size:
            st = self._waiting[0]
            need = self.cache.blocks_for(len(st.request.prompt_tokens) + self._max_new(st.request))
            if need > self.cache.num_free_blocks:
                if not self._active:
                    raise CacheFullError(f"{st.request.sample_id} needs {need} KV blocks; the pool has {self.cache.num_free_blocks} free")
                break
            self._waiting.pop(0)
            seq = _Seq(st.request, list(st.tokens), self.cache.allocate(need), list(st.logprobs), list(st.policy_versions),
                       generate_s=st.generate_s, needs_prefill=not st.has_kv)
            if st.has_kv:  # resumed: restore KV of every cached token; no prefill
                n = len(st.tokens) - 1
                if self.sparse:
                    seq.csa2 = CSA2Cache.from_tensors(st.csa2, n, self.device)
                else:
                    self.cache.load(self.cache.slots(seq.blocks, 0, n), st.kv_tensors())
                if st.routing is not None:
                    seq.routing.append(torch.from_numpy(st.routing.astype(np.int64)))
                self.stats.resumed_tokens += n
            if self.sparse and seq.csa2 is None:
                seq.csa2 = CSA2Cache()
            self._active.append(seq)
            admitted.append(seq)
        return admitted

    def _prefill(self, seqs: list[_Seq]) -> torch.Tensor:
        """Run the prompts of newly admitted sequences; returns logits at each last prompt token [B, V]."""
        lens = [len(s.tokens) for s in seqs]
        T = max(lens)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        slot_map = torch.full((len(seqs), T), -1, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.tensor(s.tokens)
            slot_map[i, : lens[i]] = torch.tensor(self.cache.slots(s.blocks, 0, lens[i]))
        ids, slot_map = ids.to(self.device), slot_map.to(self.device)
        batch = PagedBatch(self.cache, is_prefill=True, slot_mapping=slot_map)
        out = self.model.forward_hidden(ids, batch=batch)
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += sum(lens)
        self.stats.reprefill_tokens += sum(s.num_response for s in seqs)
        self.stats.prefill_seqs += len(seqs)
        last = torch.tensor(lens, device=self.device) - 1
        if out.routing is not None:
            for i, s in enumerate(seqs):
                s.routing.append(out.routing[i, : lens[i]].cpu())
        logits = self.model.logits(out.hidden[torch.arange(len(seqs), device=self.device), last])  # last positions only
        self.stats.prefill_logit_rows += logits.shape[0]
        return logits

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """Feed each sequence's last sampled token; returns next-token logits [B, V]."""
        B, bs = len(seqs), self.cache.block_size
        if self.graphs is not None:
            logits = self.graphs.run([s.tokens[-1] for s in seqs], [s.num_cached for s in seqs], [s.blocks for s in seqs])
            if logits is not None:
                self.stats.decode_steps += 1
                self.stats.graph_steps += 1
                if not self.graphs.paged_kernel:
                    self.stats.kv_gather_bytes += self._gather_bytes(self.graphs.bucket(B), self.graphs.max_blocks * bs)
                return logits
        pos = torch.tensor([s.num_cached for s in seqs], dtype=torch.long)
        ids = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.long)
        nb = max(self.cache.blocks_for(p + 1) for p in pos.tolist())
        tables = torch.tensor([s.blocks[:nb] + [0] * (nb - min(nb, len(s.blocks))) for s in seqs], dtype=torch.long)
        ctx_slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(B, nb * bs)
        slot = ctx_slots.gather(1, pos[:, None])
        mask = (torch.arange(nb * bs)[None, :] <= pos[:, None])[:, None, None, :]
        dev = self.device
        batch = PagedBatch(self.cache, False, slot.to(dev), ctx_slots.to(dev), mask.to(dev))
        logits, routing = self.model(ids[:, None].to(dev), pos[:, None].to(dev), batch=batch)
        self.stats.decode_steps += 1
        self.stats.kv_gather_bytes += self._gather_bytes(B, nb * bs)
        if routing is not None:
            r = routing[:, 0].cpu()
            for i, s in enumerate(seqs):
                s.routing.append(r[i : i + 1])
        return logits[:, 0]

    def _gather_bytes(self, rows: int, context: int) -> int:
        """K and V of `context` slots for `rows` rows in every layer, in the compute dtype (what decode's
        gather materialises)."""
        m = self.model.config
        return 2 * m.num_layers * rows * context * m.num_kv_heads * m.head_dim * self.cache.dtype.itemsize

    def _forward_csa2(self, seqs: list[_Seq], prefill: bool) -> torch.Tensor:
        """CSA2: feed each sequence's prompt (prefill) or last sampled token (decode) through its own
        CSA2Cache; returns next-token logits [B, V]. Sequences with equal cache and feed lengths run as
        one lockstep batch (their caches stacked, then split back); the rest in separate forwards."""
        feeds = [s.tokens if prefill else s.tokens[-1:] for s in seqs]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (s, f) in enumerate(zip(seqs, feeds)):
            groups.setdefault((s.csa2.length, len(f)), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for idx in groups.values():
            cache = seqs[idx[0]].csa2 if len(idx) == 1 else CSA2Cache.stack([seqs[i].csa2 for i in idx])
            ids = torch.tensor([feeds[i] for i in idx], dtype=torch.long, device=self.device)
            res = self.model.forward_hidden(ids, csa2_cache=cache)
            logits = self.model.logits(res.hidden[:, -1])  # the last fed position only
            if prefill:
                self.stats.prefill_logit_rows += logits.shape[0]
            if len(idx) > 1:
                for i, c in zip(idx, cache.split()):
                    seqs[i].csa2 = c
            for j, i in enumerate(idx):
                out[i] = logits[j]
                if res.routing is not None:
                    seqs[i].routing.append(res.routing[j].cpu())
        if prefill:
            lens = [len(f) for f in feeds]
            self.stats.prefill_calls += 1
            self.stats.prefill_tokens += sum(lens)
            self.stats.reprefill_tokens += sum(s.num_response for s in seqs)
            self.stats.prefill_seqs += len(seqs)
        else:
            self.stats.decode_steps += 1
        return torch.stack(out)

    def _sample_and_append(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        dev = logits.device
        temp = torch.tensor([s.request.temperature for s in seqs], dtype=torch.float32, device=dev)
        top_p = torch.tensor([s.request.top_p for s in seqs], dtype=torch.float32, device=dev)
        seeds = torch.tensor([s.request.seed for s in seqs], dtype=torch.long, device=dev)
        counters = torch.tensor([s.num_response for s in seqs], dtype=torch.long, device=dev)
        tokens, logprobs = sample_tokens(logits, temp, top_p, seeds, counters)
        for s, t, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(self.policy_version)
        self.stats.generated_tokens += len(seqs)

    def _finish(self, s: _Seq) -> Generation:
        self._active.remove(s)
        self.cache.free(s.blocks)
        routing = torch.cat(s.routing).to(torch.int16).numpy() if s.routing else None
        P = len(s.request.prompt_tokens)
        return Generation(
            sample_id=s.request.sample_id,
            prompt_tokens=tuple(s.request.prompt_tokens),
            response_tokens=tuple(s.tokens[P:]),
            logprobs=tuple(s.logprobs),
            policy_versions=tuple(s.versions),
            finish_reason="eos" if s.tokens[-1] in self.eos_ids and not s.request.ignore_eos else "length",
            routing_trace=routing,
            generate_s=s.generate_s,
        )

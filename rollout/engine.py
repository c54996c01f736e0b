"""Rollout engine v0: continuous batching over a paged KV cache, token-level interrupt and resume.

The engine is a plain component (no Ray); an actor shell drives it. One `step()` advances every
active sequence by exactly one token: newly admitted sequences are prefilled (which yields their first
token) and the others decode one token. Between two steps every sequence sits at a token boundary, so
`interrupt()` may be called there: each active sequence's KV slots, routing trace, logprobs and
versions move to host memory as a `RolloutState` and its blocks return to the pool. `resume(states)`
writes the KV back into fresh blocks and continues decoding with no prefill (seed §5.2.3). Finished
sequences free their blocks at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from model.decoder import Decoder
from model.kv_cache import CacheFullError, PagedBatch, PagedKVCache
from rollout.config import EngineConfig
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


class Engine:
    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_id: int, device: str | torch.device = "cpu"):
        self.model, self.cfg, self.eos_id = model, cfg, eos_id
        self.device = torch.device(device)
        mcfg = model.config
        num_blocks = cfg.num_blocks or cfg.max_batch_size * -(-cfg.max_seq_len // cfg.block_size)
        self.cache = PagedKVCache(
            num_layers=mcfg.num_layers, num_blocks=num_blocks, block_size=cfg.block_size,
            num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
            dtype=next(model.parameters()).dtype, device=self.device,
        )
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
            logits_parts.append(self._prefill(fresh))
            seqs += fresh
        decoding = old + resumed
        if decoding:
            logits_parts.append(self._decode(decoding))
            seqs += decoding
        if not seqs:
            return []
        self._sample_and_append(seqs, torch.cat(logits_parts))
        dt = time.perf_counter() - t0
        finished = []
        for s in seqs:
            s.generate_s += dt
            if (s.tokens[-1] == self.eos_id and not s.request.ignore_eos) or s.num_response >= self._max_new(s.request):
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
            slots = self.cache.slots(s.blocks, 0, s.num_cached)
            k, v = self.cache.export(slots)
            routing = torch.cat(s.routing).to(torch.int16).cpu().numpy() if s.routing else None
            states.append(RolloutState(s.request, list(s.tokens), list(s.logprobs), list(s.versions), k, v, routing, s.generate_s))
            self.cache.free(s.blocks)
        states += self._waiting
        self._active, self._waiting = [], []
        return states

    def resume(self, states: list[RolloutState]) -> None:
        """Queue interrupted states; they rejoin at the next step with their KV restored (no prefill)."""
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
                       generate_s=st.generate_s, needs_prefill=st.k is None)
            if st.k is not None:  # resumed: restore KV of every cached token; no prefill
                n = st.k.shape[1]
                self.cache.load(self.cache.slots(seq.blocks, 0, n), st.k, st.v)
                if st.routing is not None:
                    seq.routing.append(torch.from_numpy(st.routing.astype(np.int64)))
                self.stats.resumed_tokens += n
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
        logits, routing = self.model(ids, batch=batch)
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += sum(lens)
        self.stats.reprefill_tokens += sum(s.num_response for s in seqs)
        last = torch.tensor(lens, device=self.device) - 1
        if routing is not None:
            for i, s in enumerate(seqs):
                s.routing.append(routing[i, : lens[i]].cpu())
        return logits[torch.arange(len(seqs), device=self.device), last]

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """Feed each sequence's last sampled token; returns next-token logits [B, V]."""
        B, bs = len(seqs), self.cache.block_size
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
        if routing is not None:
            r = routing[:, 0].cpu()
            for i, s in enumerate(seqs):
                s.routing.append(r[i : i + 1])
        return logits[:, 0]

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
            finish_reason="eos" if s.tokens[-1] == self.eos_id and not s.request.ignore_eos else "length",
            routing_trace=routing,
            generate_s=s.generate_s,
        )

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

A sequence's tokens are a prefix whose KV is cached (`_Seq.cached`) and the pending rest, fed at the next
step: the whole prompt (prefill), the last sampled token (decode), or, after a tool call, the last sampled
token and the appended tool output ("extend": a prefill of only the new tokens over the cached context).

Shared prompt KV (`EngineConfig.share_prompt_kv`; issue #15): the samples of a GRPO group have the same
prompt. The first one admitted prefills it; the prompt's blocks go into a registry (reference-counted,
`PagedKVCache.share`), and every later sample with the same prompt, while one of them lives, holds the
full blocks, copies the last partly filled one (copy on write: it writes its own tokens there) and
starts as a decode row at the prompt's last token: P - 1 prompt tokens it never prefills. Interrupt
exports each sample's whole KV (shared blocks read like any other), so resume needs nothing shared.

Overlapped steps (`EngineConfig.overlap_steps`, on by default on CUDA; issue #15): `step()` launches the
next step before it reads the tokens of the one before, so the GPU never waits on the host's per-step work
(reading tokens, stop checks, the next step's inputs). A decode row whose last token is still on the
device takes it from there (the previous step's output, gathered in the next step's input), and its
sampling counter is one past the tokens the host has seen (`_Seq.inflight`). `step()` therefore returns
the sequences that finished at the step before the one it launched. A row that finishes or pauses at a
tool call in the step being read was launched once more: that token is dropped (`stats.discarded_tokens`;
its KV write lands in blocks freed after it in stream order, or at the position a paused sample feeds
again). `interrupt()` drops the launched step the same way: the token boundary is the last step read, and
the counter-based RNG draws the same tokens again after resume. Paged models only (CSA2 keeps per-sequence
caches: they run each step to its end); dense and MoE ones alike. An MoE row's expert ids reach its routing trace out of feed order then (a graph
step's are read with its tokens, after the next step's eager forwards appended theirs; a dropped step's
prefill left positions that are fed again): each part carries its first position and `_trace` assembles
positions [0, n). A prefill's ids are read with its step's tokens too, not at once (an interrupt that drops the
step reads them: the prefill's KV stays). MoE decode runs through the CUDA graphs (rollout/graphs.py) when its
experts run through the grouped kernels: the ids are read with the step's tokens.

Tool calls (multi-turn, issue #16): a request with `tool_calls` pauses when `tool_stop` says its response
closes a call; it keeps its blocks, leaves the batch, and waits for `append` (the tool output, fed by an
extend at the next step) or `finish_paused`. Interrupt exports paused samples too (`paused=True`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from model import fused
from model.decoder import Decoder
from model.kv_cache import CacheFullError, PagedBatch, PagedKVCache, kv_format
from model.sparse_attention import CSA2Cache
from model.sparse_attention import bytes_per_token as csa2_bytes_per_token
from rollout.config import EngineConfig
from rollout.graphs import DecodeGraphs, PrefillGraphs
from rollout.sampling import sample_tokens
from rollout.types import Generation, GenerationRequest, RolloutState, ToolCallPause


@dataclass(eq=False)
class _SharedPrompt:
    """A prompt whose KV a live sequence computed (see the module docstring)."""

    key: tuple[int, ...]
    blocks: list[int]
    """The registry's own hold on the blocks of prompt positions [0, P - 1)."""
    users: int = 1
    routing: np.ndarray | None = None
    """MoE: [P - 1, L, k] expert ids of those positions, once the owner's prefill has run."""
    waiting: list = field(default_factory=list)
    """Siblings admitted in the owner's prefill step, still without `routing`."""
    owner: object = None
    """The sequence whose prefill computes the blocks (a `_Seq`)."""
    filled: bool = True
    """The owner's KV covers positions [0, P - 1). False while a chunked prefill (`prefill_chunk_tokens`) is under way:
    siblings hold their blocks but do not decode, and their copies of the last partly filled block wait in `copies`."""
    copies: list = field(default_factory=list)
    """(src, dst) block copies for siblings, made once the entry is filled."""


def _trace(parts: list[tuple[int, np.ndarray]], n: int) -> np.ndarray | None:
    """A sequence's routing trace [n, L, k] int16, the expert ids of positions [0, n), from its parts (first fed
    position, ids [t, L, k]) whatever order they came in (with overlapped steps a graph step's ids are read after the
    next step's eager forwards appended theirs), a later part over an earlier one at the same positions (a token fed
    again after the step that fed it was dropped), positions from n on left out (an interrupt drops the launched
    step: its prefills' last positions are fed again at resume). None: a dense model."""
    if not parts:
        return None
    out = np.full((n, *parts[0][1].shape[1:]), -1, dtype=np.int16)
    for at, ids in parts:
        out[at:at + len(ids)] = ids[:max(0, n - at)]
    return out


@dataclass(eq=False)
class _Seq:
    """Engine-internal mutable state of one admitted sequence."""

    request: GenerationRequest
    tokens: list[int]
    blocks: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """Per forward: (first fed position, [num_fed_tokens, L, k] expert ids as an int16 host array; numpy: a decode
    step appends one row view per sequence, which costs a tenth of a tensor slice); `_trace` puts them in order."""
    generate_s: float = 0.0
    cached: int = 0
    """Leading tokens whose KV is in the cache; tokens[cached:] are fed at the next step."""
    csa2: CSA2Cache | None = None
    """CSA2 models: this sequence's cache (B = 1)."""
    appended: list[tuple[int, int]] = field(default_factory=list)
    """Response offsets [start, end) of appended (not sampled) tokens: tool output."""
    tool_turns: list[dict] = field(default_factory=list)
    """The worker's record of each append (`append(info=)`), with its start and end."""
    prompt: _SharedPrompt | None = None
    """The shared-prompt registry entry this sequence holds (owner or sibling)."""
    inflight: int = 0
    """Tokens sampled by launched steps and not read yet (overlapped steps: 0 or 1 between steps)."""
    admitted: int = 0
    """When the engine admitted it (a counter): under memory pressure the most recent are parked first."""

    @property
    def num_cached(self) -> int:
        return self.cached

    @property
    def pending(self) -> int:
        """Tokens the next step feeds: known ones past `cached`, and one still on the device."""
        return len(self.tokens) + self.inflight - self.cached

    @property
    def turn_start(self) -> int:
        """Response offset where the current model turn began (after the last appended span)."""
        return self.appended[-1][1] if self.appended else 0

    @property
    def num_response(self) -> int:
        return len(self.tokens) - len(self.request.prompt_tokens)


@dataclass(eq=False)
class _Step:
    """A launched step: its rows, and their sampled tokens and logprobs on the way to the host."""

    seqs: list[_Seq]
    out: torch.Tensor
    """[2, B] float64 on the device: token ids (exact below 2^53), logprobs."""
    host: torch.Tensor
    """`out` read back (pinned memory on CUDA, filled once `done` fires)."""
    done: "torch.cuda.Event | None"
    version: int
    t0: float
    dropped: set = field(default_factory=set)
    """Rows whose token here is thrown away (they finished or paused at the step before)."""
    routed: list[_Seq] = field(default_factory=list)
    """MoE, decode rows of a graph step: their expert ids are in `routing`, read with the tokens."""
    routed_at: list[int] = field(default_factory=list)
    """The position each routed row fed."""
    routing: torch.Tensor | None = None
    """[len(routed), num_layers, top_k] (pinned memory on CUDA, filled once `done` fires)."""
    prefilled: list = field(default_factory=list)
    """Overlapped MoE steps: (sequences, prompt lengths, expert ids [B, T, L, k] int16, pinned on CUDA) of this step's
    prefill, read with its tokens (`_prefill_routing`) instead of at once."""


@dataclass
class EngineStats:
    prefill_calls: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    graph_sampled_steps: int = 0
    """Decode steps whose tokens the decode graph sampled (no eager sampler after the replay)."""
    generated_tokens: int = 0
    resumed_tokens: int = 0
    """Tokens whose KV came back from a RolloutState instead of being recomputed."""
    reprefill_tokens: int = 0
    """Generated tokens that had to be prefilled again: samples parked past `park_host_gib` (their KV dropped)."""
    prefill_seqs: int = 0
    """Sequences prefilled."""
    prefill_logit_rows: int = 0
    """Rows of logits computed at prefill: one per prefilled sequence (its last prompt position)."""
    prefill_chunks: int = 0
    """Chunks fed before a sequence's last one (`prefill_chunk_tokens`): forwards that sampled nothing."""
    graph_steps: int = 0
    """Decode steps replayed from a CUDA graph (rollout/graphs.py)."""
    kv_gather_bytes: int = 0
    """Bytes of K/V copied out of the paged cache (dequantised) into temporary context tensors by decode."""
    shared_prompt_tokens: int = 0
    """Prompt tokens whose KV a sample took from a sibling's prefill (shared blocks) instead of computing."""
    shared_prompt_seqs: int = 0
    """Samples that started from a sibling's prompt KV."""
    appended_tokens: int = 0
    """Tool-output tokens appended to paused samples (and prefilled over their cached context)."""
    discarded_tokens: int = 0
    """Overlapped steps: tokens sampled for rows that had finished or paused at the step before, or in the
    step an interrupt dropped (computed, never read)."""
    parks: int = 0
    """Times a sample was parked because the KV pool ran dry (its KV to host memory, resumed when blocks free)."""
    parked_bytes: int = 0
    """Bytes of KV those parks copied out of the pool."""
    max_parks: int = 0
    """The most times any one sample was parked."""


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: CUDA's own count, or the host's available RAM for CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


class KVPoolSizeError(ValueError):
    """engine.kv_memory_fraction or kv_gib leaves less KV than one sequence needs (`rl train` prints it, exit 2)."""


def blocks_in_free_memory(cfg: EngineConfig, device: torch.device, block_bytes: float) -> int:
    """KV blocks that `cfg.kv_memory_fraction` of the free memory holds; KVPoolSizeError (one line) when that is
    less than one sequence of max_seq_len."""
    free = free_memory(device)
    blocks = int(cfg.kv_memory_fraction * free // block_bytes)
    if blocks * cfg.block_size < cfg.max_seq_len:
        raise KVPoolSizeError(f"engine.kv_memory_fraction={cfg.kv_memory_fraction} of the {free / 2**30:.2f} GiB free on {device} "
                         f"holds {blocks * cfg.block_size} tokens of KV, fewer than one sequence of max_seq_len={cfg.max_seq_len}")
    return blocks


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
        blocks = cfg.pool_blocks
        if (cfg.kv_memory_fraction is not None or cfg.kv_gib is not None) and not self.sparse:
            per_block = cfg.block_size * mcfg.num_layers * kv_format(mcfg.kv_cache.dtype).bytes_per_token_per_layer(
                mcfg.num_kv_heads, mcfg.head_dim, next(model.parameters()).dtype)
            if cfg.kv_gib is not None:
                blocks = int(cfg.kv_gib * 2**30 // per_block)
                if blocks * cfg.block_size < cfg.max_seq_len:
                    raise KVPoolSizeError(f"engine.kv_gib={cfg.kv_gib:g} holds {blocks * cfg.block_size} tokens of KV, "
                                          f"fewer than one sequence of max_seq_len={cfg.max_seq_len}")
            else:
                blocks = blocks_in_free_memory(cfg, self.device, per_block)
        self.cache = PagedKVCache(  # CSA2: no paged layers, block bookkeeping only (admission budget)
            num_layers=0 if self.sparse else mcfg.num_layers, num_blocks=blocks, block_size=cfg.block_size,
            num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
            dtype=next(model.parameters()).dtype, device=self.device, kv_dtype=mcfg.kv_cache.dtype,
        )
        if cfg.prefill_chunk_tokens is not None and self.sparse:
            raise ValueError("engine.prefill_chunk_tokens: chunked prefill is for paged models, not CSA2 (sparse_attention)")
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda" and not self.sparse and (not mcfg.is_moe or fused.GROUPED_EXPERTS):
            self.graphs = DecodeGraphs(model, self.cache, cfg.max_batch_size, self.cache.blocks_for(cfg.max_seq_len),
                                       paged_kernel=cfg.paged_decode_kernel)
        self.prefill_graphs = None
        if cfg.prefill_graphs and self.graphs is not None:  # the models the decode graphs hold, on CUDA
            self.prefill_graphs = PrefillGraphs(model, self.cache, min(cfg.max_batch_size, 64), cfg.max_seq_len)
        self.overlap = (self.device.type == "cuda" if cfg.overlap_steps is None else cfg.overlap_steps) \
            and not self.sparse
        """Launch each step before reading the previous one's tokens (module docstring)."""
        self._inflight: _Step | None = None
        self._prefilled: list = []  # this launch's prefill expert ids, deferred to the step's read (overlapped MoE)
        self.policy_version = 0
        self.stats = EngineStats()
        self.tool_stop = None
        """Multi-turn: an object with `trigger_ids` (a set of token ids) and `matches(turn_tokens) -> bool`
        (rollout/tool_calls.py's StopMatcher); a `tool_calls` request pauses when it matches."""
        self._waiting: list[RolloutState] = []
        self._active: list[_Seq] = []
        self._ready: list[_Seq] = []  # appended to after a pause: rejoin the batch at the next step
        self._since_prefill = 0  # engine steps since new prompts were last admitted (`prefill_interval`)
        self.prefill_interval = cfg.prefill_interval or (4 if self.graphs is not None else 1)
        self._paused: dict[str, _Seq] = {}
        self._new_pauses: list[ToolCallPause] = []
        self._done: list[Generation] = []  # finished outside step() (an append that filled the budget)
        self._prompts: dict[tuple[int, ...], _SharedPrompt] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) blocks to copy after this step's prefill
        self._filling: list[_SharedPrompt] = []  # shared prompts whose owner is still fed in chunks
        self._admissions = 0  # `_Seq.admitted`
        self._parks: dict[str, int] = {}  # sample id -> times parked under pressure (while it is unfinished)
        self.watermark = max(1, self.cache.num_blocks // 100)
        """Free blocks a new admission leaves for the running samples to grow into (vLLM's 1%)."""

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

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    @property
    def num_parked(self) -> int:
        """Samples waiting with their KV out of the pool: parked under memory pressure, or handed back by `resume`."""
        return sum(st.has_kv for st in self._waiting)

    @property
    def kv_used_frac(self) -> float:
        """Tokens whose KV the running and paused samples hold, over the pool's capacity in tokens."""
        held = sum(s.cached for s in (*self._active, *self._ready, *self._paused.values()))
        return held / (self.cache.num_blocks * self.cache.block_size)

    def has_work(self) -> bool:
        return bool(self._active or self._waiting or self._ready or self._paused or self._done or self._inflight)

    def oldest_versions(self) -> list[int]:
        """Version of the oldest generated token of every unfinished sequence that has one."""
        held = [*self._active, *self._ready, *self._paused.values()]
        return [s.versions[0] for s in held if s.versions] + [
            s.policy_versions[0] for s in self._waiting if s.policy_versions
        ]

    @torch.no_grad()
    def step(self) -> list[Generation]:
        """Advance every active sequence by one token; admit waiting ones. Returns finished ones (with
        overlapped steps: those that finished at the step before the one launched here)."""
        finished, self._done = self._done, []
        self._admit()
        prev, self._inflight = self._inflight, None
        launched = self._launch(prev)
        if self.overlap and launched is not None:
            self._inflight = launched  # runs on the device while the host reads `prev`
            launched = None
        for rec in (prev, launched):
            if rec is not None:
                finished += self._complete(rec)
        return finished

    def _launch(self, prev: _Step | None) -> _Step | None:
        """Queue one step of every active sequence on the device: prefill of new ones, extend after a tool
        output, decode of the rest (a row whose last token is in `prev` takes it on the device)."""
        t0 = time.perf_counter()
        chunk = self.cfg.prefill_chunk_tokens
        for e in [e for e in self._filling if e.owner.cached >= len(e.key) - 1]:
            self._filled(e)
        if not self.sparse:
            self._grow(prev)
        partial = [s for s in self._active if chunk is not None and s.pending > chunk]  # fed a chunk, sample nothing
        if partial:
            self._feed_chunks(partial, chunk)
        fresh = [s for s in self._active if s.cached == 0]
        decoding = [s for s in self._active if s.cached > 0 and s.pending == 1 and s not in partial
                    and (s.prompt is None or s.prompt.filled or s is s.prompt.owner)]  # siblings wait for the owner
        extending = [s for s in self._active if s.cached > 0 and s.pending > 1 and s not in partial]
        seqs = fresh + extending + decoding
        if not seqs:
            return None
        cuda = self.device.type == "cuda"
        at = {id(s): j for j, s in enumerate(prev.seqs)} if prev is not None else {}
        # one copy in: sampling seeds and counters, and each decode row's known token or its row in `prev`
        seeds, counters = [s.request.seed for s in seqs], [s.num_response + s.inflight for s in seqs]
        ints = torch.tensor([seeds, counters, [s.tokens[-1] if not s.inflight else 0 for s in seqs],
                             [at[id(s)] if s.inflight else -1 for s in seqs]], dtype=torch.long)
        nucleus = any(s.request.top_p < 1 for s in seqs)
        # a step of decode rows only at top_p = 1 is sampled inside the decode graph (rollout/graphs.py)
        in_graph = (seeds, counters, [s.request.temperature for s in seqs]) if (
            self.graphs is not None and self.cfg.sample_in_graph and not fresh and not extending and not nucleus) else None
        if cuda:  # pinned: the copies are truly asynchronous
            ints = ints.pin_memory()
        ints = ints.to(self.device, non_blocking=True)
        logits_parts, sampled, routing, decode_at, self._prefilled = [], None, None, [], []
        if fresh:
            logits_parts.append(self._forward_csa2(fresh, prefill=True) if self.sparse else self._prefill(fresh))
        for src, dst in self._copies:  # shared prompts' last partly filled blocks, now that their owners ran
            self.cache.copy_block(src, dst)
        self._copies = []
        if extending:
            logits_parts.append(self._forward_csa2(extending, prefill=True) if self.sparse else self._forward_cached(extending))
        if decoding:
            n = len(decoding)
            ids, row = ints[2, -n:], ints[3, -n:]
            if any(s.inflight for s in decoding):
                ids = torch.where(row >= 0, prev.out[0, row.clamp(min=0)].long(), ids)
            if self.sparse:
                logits_parts.append(self._forward_csa2(decoding, prefill=False))
            else:
                decode_at = [s.cached for s in decoding] if self.model.config.is_moe else []  # the positions fed
                logits, sampled, routing = self._decode(decoding, ids, in_graph)
                logits_parts.append(logits)
        for s in seqs:
            s.cached = len(s.tokens) + s.inflight
            s.inflight += 1
        if sampled is not None:
            out = sampled
        else:
            floats = torch.tensor([[s.request.temperature for s in seqs], [s.request.top_p for s in seqs]], dtype=torch.float32)
            floats = (floats.pin_memory() if cuda else floats).to(self.device, non_blocking=True)
            tokens, logprobs = sample_tokens(torch.cat(logits_parts), floats[0], floats[1], ints[0], ints[1], nucleus=nucleus)
            out = torch.stack([tokens.double(), logprobs.double()])  # token ids < 2^53: exact in float64
        host, done = out, None
        if cuda:  # the step's one read: into pinned memory, waited on with an event (not a device-wide sync)
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            if routing is not None:  # MoE through the decode graph: expert ids ride with the tokens
                routing = torch.empty(routing.shape, dtype=routing.dtype, pin_memory=True).copy_(routing, non_blocking=True)
            self._prefilled = [(seqs_, lens, torch.empty(r.shape, dtype=r.dtype, pin_memory=True).copy_(r, non_blocking=True))
                               for seqs_, lens, r in self._prefilled]
            done = torch.cuda.Event()
            done.record()
        return _Step(seqs, out, host, done, self.policy_version, t0,
                     routed=decoding if routing is not None else [], routing=routing,
                     routed_at=decode_at if routing is not None else [], prefilled=self._prefilled)

    def _complete(self, rec: _Step) -> list[Generation]:
        """Read a launched step's tokens (waiting for them) and apply them: append, then stop at EOS or the
        length limit, or pause at a tool call."""
        if rec.done is not None:
            rec.done.synchronize()
        self._prefill_routing(rec)
        tokens, logprobs = rec.host[0].long().tolist(), rec.host[1].tolist()
        if rec.routed:  # the fed tokens' expert ids, as the eager decode appends them; int16 (the trace's dtype), off
            ids = rec.routing.numpy().astype(np.int16)  # the trace's dtype; a copy, so rows do not hold the pinned buffer
            for j, (s, at) in enumerate(zip(rec.routed, rec.routed_at)):
                if s not in rec.dropped:
                    s.routing.append((at, ids[j:j + 1]))
        dt = time.perf_counter() - rec.t0
        nxt, finished = self._inflight, []
        for s, t, lp in zip(rec.seqs, tokens, logprobs):
            if s in rec.dropped:
                self.stats.discarded_tokens += 1
                continue
            s.inflight -= 1
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(rec.version)
            s.generate_s += dt
            self.stats.generated_tokens += 1
            again = nxt is not None and s.inflight > 0  # launched once more, in the step now running
            if self._ends(s) or s.num_response >= self._max_new(s.request):
                finished.append(self._finish(s))
                if again:
                    nxt.dropped.add(s)
            elif s.request.tool_calls and self._closes_tool_call(s):
                if again:  # the running step fed the call's last token: fed again with the tool output
                    nxt.dropped.add(s)
                    s.inflight, s.cached = s.inflight - 1, s.cached - 1
                self._active.remove(s)
                self._paused[s.request.sample_id] = s
                self._new_pauses.append(self._pause_of(s))
        return finished

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Run the given requests to completion (convenience for evaluation and tests; no tool calls)."""
        self.add(requests)
        out = []
        while self.has_work():
            if not self.runnable():
                raise RuntimeError("generate() cannot serve tool calls: samples are paused; drive step()/append()")
            out += self.step()
        order = {r.sample_id: i for i, r in enumerate(requests)}
        return sorted(out, key=lambda g: order.get(g.sample_id, len(order)))

    # -- tool calls (multi-turn) -----------------------------------------------------------------------
    def pop_paused(self) -> list[ToolCallPause]:
        """Samples that paused at a tool call since the last call (each is reported once)."""
        out, self._new_pauses = self._new_pauses, []
        return out

    def paused(self) -> list[ToolCallPause]:
        """Every sample paused now, waiting for `append` or `finish_paused` (also those resumed paused)."""
        return [self._pause_of(s) for s in self._paused.values()]

    def runnable(self) -> bool:
        """A step() would advance something (not only paused samples waiting for their tools)."""
        return bool(self._active or self._waiting or self._ready or self._done or self._inflight)

    def _pause_of(self, s: _Seq) -> ToolCallPause:
        return ToolCallPause(s.request.sample_id, tuple(s.tokens[len(s.request.prompt_tokens):]), s.turn_start,
                             len(s.tool_turns))

    def append(self, sample_id: str, tokens: Sequence[int], info: dict | None = None) -> int:
        """Append tool-output tokens to a paused sample; it rejoins the batch at the next step, which feeds
        its last sampled token and these tokens over its cached context (no re-prefill). Tokens past the
        sample's budget (max_new_tokens) are cut; a sample whose budget is then spent finishes with
        'length' (returned by the next step()). `info` (plain values: tool, call, status...) is kept with the
        span's offsets in `Generation.tool_turns`. Returns how many tokens were taken."""
        s = self._paused.pop(sample_id)
        room = self._max_new(s.request) - s.num_response
        take = list(tokens)[:max(room, 0)]
        start = s.num_response
        s.tokens += take
        s.logprobs += [0.0] * len(take)
        s.versions += [self.policy_version] * len(take)
        if take:
            s.appended.append((start, start + len(take)))
        s.tool_turns.append({**(info or {}), "start": start, "end": start + len(take)})
        self.stats.appended_tokens += len(take)
        if s.num_response >= self._max_new(s.request):
            self._done.append(self._release(s, "length"))
        else:
            self._ready.append(s)
        return len(take)

    def finish_paused(self, sample_id: str, reason: str) -> Generation:
        """End a paused sample here (e.g. its turn limit is reached, or its sandbox failed)."""
        return self._release(self._paused.pop(sample_id), reason)

    @torch.no_grad()
    def interrupt(self) -> list[RolloutState]:
        """Stop at the current token boundary: every held sequence's state (active, paused, appended to) is
        copied out of the pool (beside it with `park_kv: device`, else to host memory) and its blocks are
        freed; waiting requests are returned too (with no KV; samples parked under memory pressure with theirs)."""
        self._drop_launched()
        # `park_kv: pool` copies out only for evaluations (the train steps `pause`): to host memory, since beside a
        # pool sized to the device's memory a second copy of its KV may not fit
        states = self._export([*self._active, *self._ready, *self._paused.values()], set(self._paused),
                              to_host=self.cfg.park_kv != "device")
        states += self._waiting
        self._active, self._waiting, self._ready, self._paused = [], [], [], {}
        self._new_pauses = []
        return states

    def pause(self) -> int:
        """Stop at the current token boundary and keep every held sequence where it is, its KV in the pool (`park_kv:
        pool`): nothing is copied, the next `step` continues them (after a weight update, with the new version).
        Returns how many sequences are held."""
        self._drop_launched()
        return len(self._active) + len(self._ready) + len(self._paused)

    def snapshot(self) -> list[RolloutState]:
        """What `interrupt` would return (the held sequences' states, their KV copied to host memory, then the waiting
        ones), leaving everything in place: a checkpoint of a paused engine."""
        self._drop_launched()
        held = [*self._active, *self._ready, *self._paused.values()]
        return self._export(held, set(self._paused), to_host=True, free=False) + list(self._waiting)

    def _drop_launched(self) -> None:
        """The boundary is the last step read: the launched one (overlapped steps) is dropped (module docstring)."""
        rec, self._inflight = self._inflight, None
        if rec is None:
            return
        if rec.prefilled:  # its prefills' KV stays (all but each prompt's last position): so do their expert ids
            if rec.done is not None:
                rec.done.synchronize()
            self._prefill_routing(rec)
        for s in rec.seqs:
            if s not in rec.dropped:
                s.inflight, s.cached = s.inflight - 1, s.cached - 1
                self.stats.discarded_tokens += 1

    def _export(self, seqs: list[_Seq], paused: set[str], to_host: bool, free: bool = True) -> list[RolloutState]:
        """Each sequence's state with its KV copied out of the pool (one gather for all; to host memory or beside the
        pool) and (`free`) its blocks freed. A sibling whose shared prompt KV is not computed yet goes back as a fresh
        request."""
        states, kept = [], []
        for s in seqs:
            if s.prompt is not None and not s.prompt.filled and s is not s.prompt.owner:  # a sibling whose shared KV
                states.append(RolloutState(request=s.request, tokens=list(s.tokens)))  # is not computed yet: a fresh
                if free:  # request again (nothing generated)
                    self._free(s)
                continue
            routing = _trace(s.routing, s.cached)
            extra = dict(paused=s.request.sample_id in paused, appended_spans=list(s.appended), tool_turns=list(s.tool_turns),
                         num_cached=None if s.cached == len(s.tokens) - 1 else s.cached)
            if self.sparse:
                csa2 = {n: t.to("cpu", copy=True) for n, t in s.csa2.to_tensors().items()}
                states.append(RolloutState(s.request, list(s.tokens), list(s.logprobs), list(s.versions), None, None,
                                           routing, s.generate_s, kv_format=self.cache.format.name, csa2=csa2, **extra))
                if free:
                    self._free(s)
            else:
                kept.append((len(states), s, routing, extra))
                states.append(None)  # filled below, in this order
        # the paged KV of every kept sequence in one gather (and one copy to host memory unless kept beside the pool)
        exported = self.cache.export([self.cache.slots(s.blocks, 0, s.cached) for _, s, _, _ in kept], to_host=to_host)
        for (i, s, routing, extra), kv in zip(kept, exported):
            states[i] = RolloutState(
                s.request, list(s.tokens), list(s.logprobs), list(s.versions), kv["k"], kv["v"], routing,
                s.generate_s, kv_format=self.cache.format.name, k_scale=kv.get("k_scale"), v_scale=kv.get("v_scale"),
                **extra)
            if free:
                self._free(s)
        return states

    def resume(self, states: list[RolloutState]) -> None:
        """Queue interrupted states; they rejoin at the next step with their KV restored (no prefill).
        A state whose KV is in another storage format or layout (paged vs CSA2) is refused here."""
        mine = f"{self.cache.format.name} {'CSA2' if self.sparse else 'paged'}"
        for st in states:
            theirs = f"{st.kv_format} {'CSA2' if st.csa2 is not None else 'paged'}"
            if st.has_kv and theirs != mine:
                raise ValueError(f"{st.request.sample_id}: state holds a {theirs} KV cache; this engine stores {mine}")
            rows = st.k.shape[1] if st.k is not None else st.cached
            if st.has_kv and not (0 < st.cached <= len(st.tokens) - 1 and rows == st.cached):
                raise ValueError(f"{st.request.sample_id}: state caches {st.cached} of {len(st.tokens)} tokens "
                                 f"and holds KV of {rows}")
        self._waiting.extend(states)

    # -- internals -------------------------------------------------------------------------------
    def _max_new(self, r: GenerationRequest) -> int:
        return min(r.max_new_tokens, self.cfg.max_seq_len - len(r.prompt_tokens))

    def _closes_tool_call(self, s: _Seq) -> bool:
        stop = self.tool_stop
        if stop is None or s.tokens[-1] not in stop.trigger_ids:
            return False
        P = len(s.request.prompt_tokens)
        return bool(stop.matches(s.tokens[P + s.turn_start:]))

    def _grow(self, prev: _Step | None) -> None:
        """Give every running sequence the blocks its next step writes into (positions up to its tokens so far, the
        one in flight included). When the pool has too few, park the most recently admitted sequences (never the
        oldest, so the oldest always progresses and nothing deadlocks) until the rest fit: their KV goes to host
        memory (`_export`), their blocks back to the pool, and they wait at the head of the queue, ahead of new
        prompts, to be resumed with no re-prefill as blocks free. Their tokens do not change (sampling is
        counter-based: the token a parked sample draws next is the one it would have drawn)."""
        short = {id(s): max(0, self.cache.blocks_for(len(s.tokens) + s.inflight) - len(s.blocks)) for s in self._active}
        if sum(short.values()) > self.cache.num_free_blocks:
            victims = []
            copying = {dst for _, dst in self._copies}
            for v in sorted(self._active, key=lambda s: -s.admitted)[:-1]:  # youngest first; the oldest stays
                if sum(short.values()) <= self.cache.num_free_blocks:
                    break
                if v.cached == 0 or copying.intersection(v.blocks) or (v.prompt is not None and not v.prompt.filled):
                    continue  # prefilled at this step, or tied to a shared prompt not computed yet: not parkable now
                victims.append(v)
                short.pop(id(v))
                self._active.remove(v)
            self._park(victims, prev)
        for s in self._active:
            if short.get(id(s)):
                s.blocks += self.cache.allocate(short[id(s)])

    def _park(self, victims: list[_Seq], prev: _Step | None) -> None:
        """Move `victims` (out of `_active`) to host memory and the head of the waiting queue, oldest first."""
        if not victims:
            return
        if prev is not None:  # their token in the step still running is dropped, as an interrupt drops it
            if prev.prefilled:  # (its prefills' expert ids are read first: the prompt's KV stays with the sample)
                if prev.done is not None:
                    prev.done.synchronize()
                self._prefill_routing(prev)
            on_device = {id(s) for s in prev.seqs}
            for v in victims:
                if id(v) in on_device and v not in prev.dropped:  # (counted as discarded when `prev` is read)
                    prev.dropped.add(v)
                    v.inflight, v.cached = v.inflight - 1, v.cached - 1
        victims.sort(key=lambda s: s.admitted)
        states = self._export(victims, set(), to_host=True)
        budget = math.inf if self.cfg.park_host_gib is None else self.cfg.park_host_gib * 2**30
        held = sum(st.nbytes for st in self._waiting if st.has_kv)
        for i, st in enumerate(states):
            sid = st.request.sample_id
            self._parks[sid] = self._parks.get(sid, 0) + 1
            self.stats.max_parks = max(self.stats.max_parks, self._parks[sid])
            if st.has_kv and held + st.nbytes > budget:  # past the host budget: keep the tokens, drop the KV
                states[i] = RolloutState(st.request, st.tokens, st.logprobs, st.policy_versions, generate_s=st.generate_s,
                                         appended_spans=st.appended_spans, tool_turns=st.tool_turns)
                self.stats.reprefill_tokens += len(st.tokens) - len(st.request.prompt_tokens)
                continue
            held += st.nbytes
            self.stats.parked_bytes += st.nbytes
        self.stats.parks += len(states)
        self._waiting[0:0] = states

    def _shareable(self, st: RolloutState) -> bool:
        """A fresh request whose prompt fills at least one block before its last token."""
        return (self.cfg.share_prompt_kv and not self.sparse and not st.has_kv
                and len(st.request.prompt_tokens) - 1 >= self.cache.block_size)

    def _admit(self) -> None:
        while self._ready and len(self._active) < self.cfg.max_batch_size:
            self._active.append(self._ready.pop(0))
        self._since_prefill += 1
        prefill_now = self._since_prefill >= self.prefill_interval or not self._active
        loads = []  # resumed states' KV: restored together after the loop (one scatter per pool tensor)
        while self._waiting and (self._waiting[0].paused or len(self._active) < self.cfg.max_batch_size):
            st = self._waiting[0]
            fresh = not (st.has_kv or st.paused)  # a new prompt: prefilled in this step
            if fresh and not prefill_now:
                break
            # blocks as the sequence grows (`_grow`): now those its next step writes into (its tokens so far), with
            # `watermark` blocks left for the running samples; CSA2 keeps per-sequence caches, budgeted at the worst case
            need = self.cache.blocks_for(len(st.request.prompt_tokens) + self._max_new(st.request) if self.sparse
                                         else len(st.tokens))
            entry = self._prompts.get(st.request.prompt_tokens) if self._shareable(st) else None
            full = (len(st.request.prompt_tokens) - 1) // self.cache.block_size if entry is not None else 0
            running = bool(self._active or self._paused or self._ready)
            if need - full + (self.watermark if running and not self.sparse else 0) > self.cache.num_free_blocks:
                if not running:
                    raise CacheFullError(f"{st.request.sample_id} needs {need} KV blocks; the pool has {self.cache.num_free_blocks} free")
                break
            self._waiting.pop(0)
            if fresh:
                self._since_prefill = 0
            blocks = self.cache.share(entry.blocks[:full]) + self.cache.allocate(need - full) if entry else self.cache.allocate(need)
            seq = _Seq(st.request, list(st.tokens), blocks, list(st.logprobs), list(st.policy_versions),
                       generate_s=st.generate_s, cached=st.cached, appended=list(st.appended_spans),
                       tool_turns=list(st.tool_turns), admitted=self._admissions)
            self._admissions += 1
            if entry is not None:
                self._join_prompt(seq, entry, full)
            elif self._shareable(st):  # the first of its prompt: its prefill at this step fills the registry's blocks
                P = len(st.request.prompt_tokens)
                key = st.request.prompt_tokens
                chunk = self.cfg.prefill_chunk_tokens
                seq.prompt = self._prompts[key] = _SharedPrompt(key, self.cache.share(blocks[:self.cache.blocks_for(P - 1)]),
                                                                owner=seq, filled=chunk is None or P <= chunk)
                if not seq.prompt.filled:  # fed in chunks over the next steps: siblings wait for the last one
                    self._filling.append(seq.prompt)
            if st.has_kv:  # resumed: restore KV of every cached token; no prefill
                n = st.cached
                if self.sparse:
                    seq.csa2 = CSA2Cache.from_tensors(st.csa2, n, self.device)
                else:
                    loads.append((self.cache.slots(seq.blocks, 0, n), st.kv_tensors()))
                if st.routing is not None:
                    seq.routing.append((0, st.routing.astype(np.int16)))
                self.stats.resumed_tokens += n
            if self.sparse and seq.csa2 is None:
                seq.csa2 = CSA2Cache()
            if st.paused:
                self._paused[st.request.sample_id] = seq
            else:
                self._active.append(seq)
        self.cache.load(loads)

    def _join_prompt(self, seq: _Seq, entry: _SharedPrompt, full: int) -> None:
        """A sibling starts from `entry`'s prompt KV: it holds the `full` blocks, copies the last partly
        filled one into its own block, and is fed the prompt's last token as a decode row."""
        P = len(seq.request.prompt_tokens)
        if full < len(entry.blocks):  # positions [full·bs, P - 1) live in a block the sibling will write into;
            (self._copies if entry.filled else entry.copies).append((entry.blocks[full], seq.blocks[full]))  # copied
            # once the owner's prefill ran (this step's, or its last chunk's)
        entry.users += 1
        seq.prompt, seq.cached = entry, P - 1
        if entry.routing is not None:
            seq.routing.append((0, entry.routing))
        elif self.model.config.is_moe:
            entry.waiting.append(seq)
        self.stats.shared_prompt_tokens += P - 1
        self.stats.shared_prompt_seqs += 1

    def _filled(self, e: _SharedPrompt) -> None:
        """A chunked owner's KV now covers its prompt: the siblings' block copies are queued (made after this step's
        prefill, before any decode), MoE siblings get the prompt's expert ids, and they decode from this step on."""
        self._filling.remove(e)
        e.filled = True
        self._copies += e.copies
        e.copies = []
        if e.owner.routing:
            e.routing = _trace(e.owner.routing, len(e.key) - 1)
            for sib in e.waiting:
                sib.routing.append((0, e.routing))
            e.waiting = []

    def _feed_chunks(self, seqs: list[_Seq], chunk: int) -> None:
        """Chunked prefill: feed `chunk` more tokens of each sequence (its first chunk as a prefill, later ones over
        its cached context), computing no logits; the chunk that ends its prompt is fed as usual, and sampled."""
        first = [s for s in seqs if s.cached == 0]
        if first:
            self._prefill(first, chunk)
        if len(first) < len(seqs):
            self._forward_cached([s for s in seqs if s.cached > 0], feed=chunk)
        for s in seqs:
            s.cached += chunk
        self.stats.prefill_chunks += len(seqs)

    def _prefill(self, seqs: list[_Seq], chunk: int | None = None) -> torch.Tensor | None:
        """Run the prompts of newly admitted sequences; returns logits at each last prompt token [B, V]. `chunk`:
        only each one's first `chunk` tokens, and no logits (chunked prefill)."""
        lens = [len(s.tokens) if chunk is None else chunk for s in seqs]
        slots = [self.cache.slots(s.blocks, 0, n) for s, n in zip(seqs, lens)]
        got = None if chunk is not None or self.prefill_graphs is None else self.prefill_graphs.run(
            [s.tokens[:n] for s, n in zip(seqs, lens)], slots)
        if got is not None:
            logits, routing = got
        else:
            T = max(lens)
            ids = torch.zeros(len(seqs), T, dtype=torch.long)
            slot_map = torch.full((len(seqs), T), -1, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : lens[i]] = torch.tensor(s.tokens[: lens[i]])
                slot_map[i, : lens[i]] = torch.tensor(slots[i])
            ids, slot_map = ids.to(self.device), slot_map.to(self.device)
            out = self.model.forward_hidden(ids, batch=PagedBatch(self.cache, is_prefill=True, slot_mapping=slot_map))
            routing, logits = out.routing, None
            if chunk is None:
                last = torch.tensor(lens, device=self.device) - 1
                logits = self.model.logits(out.hidden[torch.arange(len(seqs), device=self.device), last])  # last positions only
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += sum(lens)
        self.stats.reprefill_tokens += sum(s.num_response for s in seqs)
        self.stats.prefill_seqs += len(seqs)
        if routing is not None and self.overlap and chunk is None:  # read with the step's tokens, not now
            self._prefilled.append((seqs, lens, routing.to(torch.int16)))
        elif routing is not None:
            self._add_prompt_routing(seqs, lens, routing.to(torch.int16).cpu().numpy(), owner=chunk is None)  # one read
        if chunk is not None:
            return None
        self.stats.prefill_logit_rows += logits.shape[0]
        return logits

    def _add_prompt_routing(self, seqs: list[_Seq], lens: list[int], r: np.ndarray, owner: bool) -> None:
        """Each prefilled sequence's expert ids (positions 0..); `owner`: a whole prompt, so a shared prompt's owner
        hands its prompt positions' ids to the siblings (a chunked owner's are complete after its last chunk: `_filled`)."""
        for i, s in enumerate(seqs):
            s.routing.append((0, r[i, : lens[i]]))
            if owner and s.prompt is not None and s.prompt.routing is None:
                s.prompt.routing = r[i, : lens[i] - 1]
                for sib in s.prompt.waiting:
                    sib.routing.append((0, s.prompt.routing))
                s.prompt.waiting = []

    def _prefill_routing(self, rec: _Step) -> None:
        """An overlapped step's prefill expert ids, once its copy has landed (`rec.done`); once."""
        for seqs, lens, r in rec.prefilled:
            self._add_prompt_routing(seqs, lens, r.numpy(), owner=True)
        rec.prefilled = []

    def _decode(self, seqs: list[_Seq], ids: torch.Tensor, sampling=None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Feed each sequence's last sampled token (`ids` [B] on the device); returns (next-token logits [B, V],
        the tokens and logprobs [2, B] the decode graph sampled with `sampling` = (seeds, counters, temperatures),
        or None: sample the logits; MoE through the graph: the fed tokens' expert ids [B, num_layers, top_k] on the
        device, for the step to read with its tokens, else None: the eager forward appended them already)."""
        if self.graphs is not None:
            got = self.graphs.run(ids, [s.cached for s in seqs], [s.blocks for s in seqs], sampling)
            if got is not None:
                self.stats.decode_steps += 1
                self.stats.graph_steps += 1
                if not self.graphs.paged_kernel:
                    self.stats.kv_gather_bytes += self._gather_bytes(self.graphs.bucket(len(seqs)),
                                                                     self.graphs.max_blocks * self.cache.block_size)
                if sampling is not None:
                    self.stats.graph_sampled_steps += 1
                return got[0], got[1] if sampling is not None else None, got[2]
        logits = self._forward_cached(seqs, ids[:, None])
        self.stats.decode_steps += 1
        return logits, None, None

    def _forward_cached(self, seqs: list[_Seq], ids: torch.Tensor | None = None, feed: int | None = None
                        ) -> torch.Tensor | None:
        """Feed each sequence's pending tokens (one at decode; the last sampled token and the appended ones
        after a tool call) at positions cached.., attending over its cached context and causally over
        themselves; returns logits at each last fed token [B, V]. Eager: gathers the context. `ids` [B, T]
        on the device: the fed tokens when the caller has them there (decode). `feed`: only the next `feed`
        tokens of each (a chunk of a chunked prefill), and no logits."""
        B, bs = len(seqs), self.cache.block_size
        n = [s.pending if feed is None else feed for s in seqs]
        T = max(n)
        pos = torch.tensor([[s.cached + min(t, k - 1) for t in range(T)] for s, k in zip(seqs, n)], dtype=torch.long)
        valid = torch.tensor([[t < k for t in range(T)] for k in n])
        if ids is None:
            ids = torch.tensor([s.tokens[s.cached:s.cached + k] + [0] * (T - k) for s, k in zip(seqs, n)], dtype=torch.long)
        nb = max(self.cache.blocks_for(s.cached + k) for s, k in zip(seqs, n))
        tables = torch.tensor([s.blocks[:nb] + [0] * (nb - min(nb, len(s.blocks))) for s in seqs], dtype=torch.long)
        ctx_slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(B, nb * bs)
        slot = torch.where(valid, ctx_slots.gather(1, pos), torch.full_like(pos, -1))  # padding -> the scratch slot
        mask = (torch.arange(nb * bs)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        dev = self.device
        batch = PagedBatch(self.cache, False, slot.to(dev), ctx_slots.to(dev), mask.to(dev))
        out = self.model.forward_hidden(ids.to(dev), pos.to(dev), batch=batch)
        self.stats.kv_gather_bytes += self._gather_bytes(B, nb * bs)
        if T > 1:
            self.stats.prefill_tokens += sum(n)
        if out.routing is not None:
            r = out.routing.to(torch.int16).cpu().numpy()  # the trace's dtype
            for i, (s, k) in enumerate(zip(seqs, n)):
                s.routing.append((s.cached, r[i, :k]))
        if feed is not None:
            return None
        last = torch.tensor([k - 1 for k in n], device=dev)
        return self.model.logits(out.hidden[torch.arange(B, device=dev), last])

    def _gather_bytes(self, rows: int, context: int) -> int:
        """K and V of `context` slots for `rows` rows in every layer, in the compute dtype (what decode's
        gather materialises)."""
        m = self.model.config
        return 2 * m.num_layers * rows * context * m.num_kv_heads * m.head_dim * self.cache.dtype.itemsize

    def _forward_csa2(self, seqs: list[_Seq], prefill: bool) -> torch.Tensor:
        """CSA2: feed each sequence's pending tokens (prompt at prefill, the last sampled token at decode, the
        tool output after a tool call) through its own CSA2Cache; returns next-token logits [B, V]. Sequences
        with equal cache and feed lengths run as one lockstep batch (their caches stacked, then split
        back); the rest in separate forwards."""
        feeds = [s.tokens[s.cached:] for s in seqs]
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
                    seqs[i].routing.append((seqs[i].cached, res.routing[j].to(torch.int16).cpu().numpy()))
        if prefill:
            lens = [len(f) for f in feeds]
            self.stats.prefill_calls += 1
            self.stats.prefill_tokens += sum(lens)
            self.stats.reprefill_tokens += sum(s.num_response for s in seqs if s.cached == 0)
            self.stats.prefill_seqs += len(seqs)
        else:
            self.stats.decode_steps += 1
        return torch.stack(out)

    def _free(self, s: _Seq) -> None:
        """Let go of a sequence's blocks, and of its shared prompt's when it was the prompt's last user."""
        self.cache.free(s.blocks)
        e = s.prompt
        if e is not None:
            e.users -= 1
            if s in e.waiting:
                e.waiting.remove(s)
            if e.users == 0:
                self.cache.free(e.blocks)
                del self._prompts[e.key]
                if e in self._filling:
                    self._filling.remove(e)
            s.prompt = None

    def _finish(self, s: _Seq) -> Generation:
        self._active.remove(s)
        return self._release(s, "eos" if self._ends(s) else "length")

    def _ends(self, s: _Seq) -> bool:
        """The last token ends the response: an EOS id (unless ignored), or the request's forced end (`eos_at`)."""
        r = s.request
        return (s.tokens[-1] in self.eos_ids and not r.ignore_eos) or (r.eos_at is not None and s.num_response >= r.eos_at)

    def _release(self, s: _Seq, reason: str) -> Generation:
        self._free(s)
        self._parks.pop(s.request.sample_id, None)
        routing = _trace(s.routing, min(s.cached, len(s.tokens) - 1))  # fed positions; a token launched once more is not one
        P = len(s.request.prompt_tokens)
        return Generation(
            sample_id=s.request.sample_id,
            prompt_tokens=tuple(s.request.prompt_tokens),
            response_tokens=tuple(s.tokens[P:]),
            logprobs=tuple(s.logprobs),
            policy_versions=tuple(s.versions),
            finish_reason=reason,
            routing_trace=routing,
            generate_s=s.generate_s,
            appended_spans=tuple(s.appended),
            tool_turns=tuple(s.tool_turns),
        )

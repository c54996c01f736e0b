"""Engine configuration (pure pydantic; no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from configbase import StrictConfig


class SamplingConfig(StrictConfig):
    """How the engine turns logits into tokens."""

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 means greedy. Behaviour logprobs are recorded under this temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1 keeps the whole vocabulary."""


class EngineConfig(StrictConfig):
    """Continuous-batching generation engine over a paged KV cache."""

    max_batch_size: int = Field(256, gt=0)
    """Most sequences decoded together in one step; others wait and join as sequences finish."""
    block_size: int = Field(16, gt=0)
    """Tokens per KV-cache block."""
    num_blocks: int | None = Field(None, gt=0)
    """KV-cache blocks in the pool; default: enough for max_batch_size sequences of max_seq_len."""
    kv_memory_fraction: float | None = Field(None, gt=0, lt=1)
    """Size the KV pool to this share of the device memory free when the engine starts (CUDA: what
    torch.cuda.mem_get_info reports free; CPU: the host's available RAM), like vLLM's gpu_memory_utilization but
    of what is free after the weights: leave room for what training allocates later (gradients, AdamW moments,
    logits). Dense paged models; not with num_blocks. None: num_blocks, or its default."""
    kv_gib: float | None = Field(None, gt=0)
    """Size the KV pool to this many GiB in the cache's storage format (bf16, fp8 or fp4: an FP4 pool holds ~3.6x the
    tokens of a bf16 one in the same GiB). Dense paged models; not with num_blocks or kv_memory_fraction."""
    max_seq_len: int = Field(256, gt=0)
    """Longest prompt + response the engine holds; also caps max_new_tokens per request."""
    max_prompt_tokens: int | None = Field(None, gt=0)
    """Longest prompt, in tokens, a rollout or evaluation starts from; a problem whose prompt is longer is
    dropped and counted (`rollout/prompts_too_long`, `eval/<dataset>/prompts_too_long`). None: max_seq_len - 1."""
    overlong_prompts: Literal["refuse", "drop"] = "refuse"
    """A prompt longer than that limit, found when the job starts (every row of a dataset file; a procedural
    dataset's held-out set and first train draws, at every effort level): refuse: the job does not start, one
    line names the row and its length (verl's default, `truncation: error`); drop: such prompts are skipped and
    counted, as verl's `filter_overlong_prompts` (a dataset none of whose prompts fits is refused either way)."""
    max_new_tokens: int = Field(128, gt=0)
    """Default response length limit; a sequence stops with finish_reason 'length' there."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Default sampling settings of rollouts."""
    cuda_graphs: bool = True
    """On CUDA, replay each decode step from a CUDA graph captured per batch-size bucket (rollout/graphs.py);
    paged models (MoE ones when their experts run through the grouped kernels, model/fused.py GROUPED_EXPERTS;
    CSA2 models decode eagerly). False: always eager."""
    prefill_graphs: bool = True
    """Where decode steps replay CUDA graphs, replay prefills from graphs too, one per (rows, tokens) bucket (rollout/
    graphs.py PrefillGraphs: prompts right-padded to the bucket; the logits and expert ids of the real tokens as an
    eager prefill computes them). Measured on an H200 with bench/async_dispatch.py --engine-ab (BENCHMARKS.md).
    False: prefills run eagerly."""
    share_prompt_kv: bool = True
    """Samples with the same prompt (a GRPO group) prefill it once: later ones hold its KV blocks
    (reference-counted, the last partly filled block copied) and start decoding at its last token."""
    overlap_steps: bool | None = None
    """Launch each step before reading the tokens of the one before, so the device never waits on the host
    (rollout/engine.py); finished samples come back one step later. None: on CUDA (dense and MoE models). CSA2
    models never overlap."""
    prefill_interval: int | None = Field(None, gt=0)
    """New prompts are admitted (prefilled) at most every this many engine steps while other sequences decode;
    an idle engine admits at once, and resumed or paused states (no prefill) join at once. A step with a
    prefill runs the prompts' forward eagerly and samples after it, so under sample-level dispatch, where a
    group is released whenever one finishes, 1 can make most steps prefill steps; larger values gather releases
    into fewer, larger prefills at up to that many steps of delay. Tokens are unchanged (counter-based sampling per
    sample). None: 4 where decode steps replay CUDA graphs (an eager prefill step costs several graph steps there:
    BENCHMARKS.md, "MoE experts grouped on the GPU"), else 1."""
    prefill_chunk_tokens: int | None = Field(None, gt=0)
    """Chunked prefill: a prompt (or a resumed state's uncached tokens, or a tool output) longer than this is fed
    this many tokens per engine step, each chunk over the KV the chunks before it cached, while the other
    sequences keep decoding; its first token is sampled after its last chunk. A long prompt then costs every
    other sample a few bounded steps instead of one long one (interrupts land at step boundaries), and a step's
    activations stay bounded. A group sharing such a prompt (`share_prompt_kv`) holds its blocks from admission and
    starts decoding once its last chunk has run. Same tokens. None: whole prompts in one step. Paged models only
    (not CSA2)."""
    park_kv: Literal["pool", "device", "host"] = "pool"
    """Where in-flight samples' KV waits during a train step (seed §5.2.3). `pool` (default): where it is; the engine
    stops at the token boundary and continues after the weight update with nothing copied (the trainer works beside the
    pool: its micro-batches are sized to the memory left, rl/runtime/memory.py `token_cap`); a checkpoint copies the
    states out to write them. `device`: every held sequence's cached rows copied out of the pool in one gather into a
    tensor on the engine's device and restored with one scatter (a second copy of the in-flight KV while they wait);
    `host`: that copy in host memory. Evaluations (`rl eval`, eval_every, the stage end) copy the states out whatever
    this says (they need the pool's blocks; with `pool`, to host memory). The same tokens either way."""
    park_host_gib: float | None = Field(None, gt=0)
    """Host memory that samples parked under KV memory pressure may hold (rollout/engine.py `_grow`); a park that
    would pass it drops the sample's KV instead, and the sample is prefilled again (prompt and response so far) when
    it resumes, counted in `reprefill_tokens`. None: no limit."""
    sample_in_graph: bool = True
    """A decode step whose rows all sample at top_p = 1 draws its tokens inside the decode graph (rollout/graphs.py)
    instead of with ~40 eagerly launched sampler kernels after the replay; same tokens. False: always after."""
    expected_tokens: int | None = Field(None, gt=0)
    """The prompt + response tokens a sample is expected to hold on average while it is in flight, for `rl validate`'s
    arithmetic only: how many samples the KV pool holds at that length beside how many at max_seq_len (the engine
    allocates blocks as samples grow, so the first is what it sustains; rollout/engine.py `_grow`). None: not shown."""
    paged_decode_kernel: bool = True
    """In graphed decode, attend through the paged Triton kernel, which reads the cache in its storage
    format (bf16, fp8, fp4) with no gathered copy; False: gather a fixed-length context, then SDPA."""

    @model_validator(mode="after")
    def _pool_holds_a_sequence(self) -> "EngineConfig":
        if self.num_blocks is not None and self.num_blocks * self.block_size < self.max_seq_len:
            raise ValueError(f"num_blocks={self.num_blocks} of block_size={self.block_size} hold "
                             f"{self.num_blocks * self.block_size} tokens, fewer than one sequence of "
                             f"max_seq_len={self.max_seq_len}")
        return self

    @model_validator(mode="after")
    def _expected_within_max(self) -> "EngineConfig":
        if self.expected_tokens is not None and self.expected_tokens > self.max_seq_len:
            raise ValueError(f"expected_tokens={self.expected_tokens} is more than max_seq_len={self.max_seq_len}, the "
                             "most a sample can hold")
        return self

    @model_validator(mode="after")
    def _one_pool_size(self) -> "EngineConfig":
        given = [k for k in ("num_blocks", "kv_memory_fraction", "kv_gib") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError("give one of num_blocks (a count), kv_memory_fraction (a share of free memory) or kv_gib "
                             f"(an amount), not {' and '.join(given)}")
        return self

    @model_validator(mode="after")
    def _prompt_fits(self) -> "EngineConfig":
        if self.max_prompt_tokens is not None and self.max_prompt_tokens >= self.max_seq_len:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} leaves no room for a response in "
                             f"max_seq_len={self.max_seq_len}")
        return self

    @property
    def pool_blocks(self) -> int:
        """KV blocks in the pool: num_blocks, or enough for max_batch_size sequences of max_seq_len."""
        return self.num_blocks or self.max_batch_size * -(-self.max_seq_len // self.block_size)

    @property
    def prompt_limit(self) -> int:
        """Longest prompt the engine is given: max_prompt_tokens, or max_seq_len - 1 (room for one token)."""
        return self.max_prompt_tokens or self.max_seq_len - 1

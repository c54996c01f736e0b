"""The `Recipe` root and the configs of the rl-side components (pure pydantic: no torch, no ray).

A recipe is a YAML file that loads into `Recipe` (see `rl.recipe_io`); `--set a.b=c` overrides apply
before validation. Variants are discriminated unions on `type`; cross-component rules are the
`validate_*` methods on the root.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from configbase import StrictConfig
from model.config import CharTokenizerConfig, HFTokenizerConfig, ModelConfig, TokenizerConfig, weight_differences
from rewards.config import DatasetConfig
from rewards.effort import EffortConfig
from rl.dispatch import DispatchConfig
from teachers.config import TeacherPoolConfig
from rollout.config import EngineConfig
from rollout.tool_calls import PYTHON_TOOL, RUN_ARGUMENT, ToolSpec, check_parameters_schema, tool_result_tokens
from sandbox_client.records import Limits


PACKED_TOKENS_CUDA = 16384
"""Tokens per packed micro-batch on CUDA when the stage sets neither micro_batch_size nor micro_batch_tokens
(verl's ppo_max_token_len_per_gpu default): micro-batches by tokens, so a long-tail batch's long rows do not
share a forward with many others, and short rows fill a forward to the same work."""


class RunConfig(StrictConfig):
    """Identity, seeding and placement of a run."""

    name: str = "run"
    """Run name (letters, digits, '.', '_', '-'; not a path); the default run directory is runs/<name>."""
    seed: int = 0
    """Seed of model init, data order and sampling."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the policy (engine and trainer share it)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the policy. float32: one module in float32 for the engine and the trainer. bfloat16:
    mixed precision, as verl and prime-rl train: the trainer keeps float32 master weights and AdamW state and
    runs the forward under bf16 autocast; the engine decodes with a bf16 copy of the weights (its KV cache in
    bf16 too), refreshed in place after every optimizer step, before the version advances (rl/runtime/worker.py)."""
    num_threads: int = Field(2, gt=0)
    """torch intra-op threads on CPU."""
    compile: Literal["auto", "layers", "ops", "off"] = "auto"
    """torch.compile for the training forward (model/compile.py): the norms, RoPE, SwiGLU and residual adds fused into
    Triton kernels around the matmuls and attention. layers: each dense decoder layer compiled whole (MoE and CSA2
    layers take ops); ops: only the elementwise functions; off (or false): eager; true: layers. auto: layers on CUDA with dtype bfloat16 and
    one worker or DDP, off elsewhere (on CPU inductor's C++ build costs more than it saves; under FSDP2 not yet
    tried). The first train step pays the compilation (tens of seconds at a few-billion-parameter shape). Measured
    on an H200 (BENCHMARKS.md, issue 41): a GRPO step 2.3x faster at the Qwen3-0.6B shape, 1.6x at 1.7B."""
    device_memory_gib: float | None = Field(None, gt=0)
    """Memory of one worker's device, GiB, for `rl validate`'s estimate (rl/runtime/memory.py) on a host without
    that device; None: the device's own (CUDA), the host's RAM (CPU), or not checked."""
    init_checkpoint: Path | None = None
    """Start from this checkpoint directory (config.json + model.safetensors) instead of random init."""

    @field_validator("compile", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: Any) -> Any:
        # YAML reads `compile: off` (and no / false) as False, `on` / yes / true as True
        return {False: "off", True: "layers"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v):
            raise ValueError(f"{v!r} is not a plain name: use letters, digits, '.', '_' and '-' (at most 128, "
                             "not starting with '.' or '-'); it names runs/<name>, so no path")
        return v

    @field_validator("init_checkpoint")
    @classmethod
    def _exists(cls, p: Path | None) -> Path | None:
        if p is not None and not (p / "model.safetensors").is_file():
            raise ValueError(f"checkpoint directory {str(p)!r} does not exist or has no model.safetensors")
        return p


class OptimConfig(StrictConfig):
    """AdamW with linear warm-up and gradient-norm clipping."""

    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to lr."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant lr, or cosine decay to 0 over the stage's max_steps."""


class SFTStage(StrictConfig):
    """Supervised warm start on worked solutions (which may contain the demonstrator's slips)."""

    type: Literal["sft"] = "sft"
    """Discriminator: a supervised fine-tuning stage."""
    max_steps: int = Field(1000, gt=0)
    """Optimizer steps at most."""
    max_minutes: float | None = Field(None, gt=0)
    """Wall-clock budget; the stage ends at whichever of max_steps / max_minutes comes first."""
    batch_size: int = Field(64, gt=0)
    """Demonstrations per optimizer step."""
    datasets: list[str] | None = Field(None, min_length=1)
    """The datasets this stage draws its prompts from (names in `datasets:`); None: all of them. A pipeline may SFT on
    one set and run RL on another (seed §5.1.1: cold-start SFT data, then RL prompts)."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Demonstrations per forward/backward (gradients accumulate over a step); None: a worker's whole share."""
    micro_batch_tokens: int | None = Field(None, gt=0)
    """Tokens per forward/backward at most (packed: the rows' tokens; padded: rows × the longest row's; verl's
    dynamic batch size):
    micro-batches are cut by tokens instead of rows, so short rows share a forward and long ones get their own
    (a row longer than this goes alone). Set, it replaces micro_batch_size."""
    packing: Literal["auto", "packed", "padded"] = "auto"
    """How a micro-batch's rows reach the forward: `packed` back to back with no padding, attention masked to each
    row (FlashAttention's variable-length kernel on CUDA, model/varlen.py), or `padded` to the longest row. `auto`:
    packed on CUDA, padded on CPU (where the packed layout runs one attention call per row). With packing on CUDA and
    neither micro-batch field set, micro-batches are cut at 16,384 tokens (rl/train/trainer.py
    `PACKED_TOKENS_CUDA`). CSA2 models and OPD stages always run padded (a CSA2 layer's compressed entries span a
    whole row; OPD teachers read the padded rows)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer of this stage."""
    effort_prefix_frac: float = Field(1.0, ge=0, le=1)
    """With effort conditioning on: share of demonstrations whose prompt carries the effort prefix
    (a random training level). The rest have none."""
    effort_cold_start: bool = False
    """Demonstrations prefixed with level b show reasoning that grows with b (see cold_start_style): a
    tiny model has no language prior to read the prefix's meaning from, so SFT shows it once; RL with
    the length penalty then sets the trade-off. False: demonstrations ignore the level. A file dataset needs its
    `direct_demonstration` (the answer without the reasoning)."""
    cold_start_style: Literal["direct", "partial"] = "direct"
    """`direct`: at level b skip the scratchpad with probability 1 − b/100 (all or nothing);
    `partial`: keep the first round(b/100 · n) of the n worked lines (graded length)."""
    log_every: int = Field(20, gt=0)
    """Log metrics every this many steps."""


class ImportanceConfig(StrictConfig):
    """Which ratio the clip acts on, and the truncated importance weight (rl/train/losses.py states the objective)."""

    ratio: Literal["behavior", "proximal"] = "behavior"
    """behavior: clip π_θ/π_behav; proximal: clip π_θ/sg(π_θ) and weight by sg(π_θ/π_behav)."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncate the proximal importance weight at this value (None: no truncation)."""

    @model_validator(mode="after")
    def _cap_needs_proximal(self) -> "ImportanceConfig":
        if self.tis_cap is not None and self.ratio != "proximal":
            raise ValueError("tis_cap applies to ratio: proximal only")
        return self


class GRPOStage(StrictConfig):
    """Group-relative policy optimisation on verifier rewards, on the asynchronous runtime."""

    type: Literal["grpo"] = "grpo"
    """Discriminator: a GRPO stage."""
    max_steps: int = Field(200, gt=0)
    """Optimizer steps at most (one per batch of prompts_per_step groups)."""
    max_minutes: float | None = Field(None, gt=0)
    """Wall-clock budget; the stage ends at whichever of max_steps / max_minutes comes first (checked between steps
    and at every rollout call, so a rollout phase that has not filled its batch ends there too)."""
    prompts_per_step: int = Field(32, gt=0)
    """Groups (prompts) per train batch."""
    datasets: list[str] | None = Field(None, min_length=1)
    """The datasets this stage draws its prompts from (names in `datasets:`); None: all of them. A pipeline may SFT on
    one set and run RL on another (seed §5.1.1: cold-start SFT data, then RL prompts)."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt; advantages are relative within the group."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the importance ratio: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip of the importance ratio: ratio <= 1 + clip_high (decoupled, as DAPO)."""
    std_normalize: bool = False
    """Divide group-centred advantages by the group's reward std (GRPO) or not (Dr. GRPO)."""
    micro_batch_size: int = Field(64, gt=0)
    """Samples per forward/backward; gradients accumulate over a step."""
    micro_batch_tokens: int | None = Field(None, gt=0)
    """Tokens per forward/backward at most (packed: the rows' tokens; padded: rows × the longest row's; verl's
    dynamic batch size):
    micro-batches are cut by tokens instead of rows, so short samples share a forward and long ones get their
    own (a sample longer than this goes alone). Set, it replaces micro_batch_size."""
    packing: Literal["auto", "packed", "padded"] = "auto"
    """How a micro-batch's rows reach the forward: `packed` back to back with no padding, attention masked to each
    row (FlashAttention's variable-length kernel on CUDA, model/varlen.py), or `padded` to the longest row. `auto`:
    packed on CUDA, padded on CPU (where the packed layout runs one attention call per row). With packing on CUDA and
    neither micro-batch field set, micro-batches are cut at 16,384 tokens (rl/train/trainer.py
    `PACKED_TOKENS_CUDA`). CSA2 models and OPD stages always run padded (a CSA2 layer's compressed entries span a
    whole row; OPD teachers read the padded rows)."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimizer of this stage."""
    log_every: int = Field(1, gt=0)
    """Log metrics every this many steps."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every this many steps (0: only at the end of the stage)."""
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    """Dispatch policy, in-flight bound, per-dataset caps, off-policy bounds, warm-up discard."""
    steps_per_call: int = Field(1, gt=0)
    """Engine steps per controller round trip; interrupts land within this many steps."""
    pipelined_calls: bool = True
    """With Ray workers: the next rollout call is queued on the workers before the controller reads the previous
    call's results, so an engine never waits for the controller's round trip (rl/algo/async_grpo.py); new prompts and
    the end of a rollout phase take effect one call later (interrupts land within 2 x steps_per_call steps).
    In-process workers ignore it: their calls have no round trip."""
    calls_ahead: int = Field(1, ge=1, le=8)
    """With pipelined calls: how many rollout calls stay queued on the workers while the controller reads a call's
    results. One hides the controller's handling of a call when it is shorter than a call; more absorb handling that
    is longer at times (a store commit, a burst of verdicts), and new prompts join that many calls later
    (`time/worker_gap_s`: the workers' waits between calls)."""
    max_staleness: int | None = Field(None, ge=0)
    """Tokens generated more than this many versions before the trained weights leave the loss;
    the normaliser keeps them (seed §5.2.2). None: no masking."""
    max_sample_stale_frac: float | None = Field(None, ge=0, le=1)
    """Drop a whole sample from the loss when its share of masked stale tokens exceeds this."""
    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
    """Importance correction against the recorded behaviour logprobs."""
    kl_ref_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty to the run's initial policy (k3 estimator per token, rl/train/losses.py
    `reference_kl`); 0: no reference model is kept."""
    mini_batches: int = Field(1, gt=0)
    """Optimizer steps per train step (PPO mini-batches: verl's ppo_mini_batch_size = prompts_per_step /
    mini_batches, TRL's steps_per_generation): the step's groups (the uniform ones left out, below) are dealt into
    this many mini-batches of whole groups, balanced by tokens, and each takes one AdamW step in turn, its loss
    normalised by its own share of the step's tokens. Later mini-batches are off-policy by the earlier ones'
    updates, which the clipped ratio against the behaviour logprobs bounds; the policy version advances once
    per train step (the engine's weights change once). Fewer when the step has fewer groups than
    mini_batches x workers. The cosine schedule decays over max_steps x mini_batches optimizer steps."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (verl's entropy_coeff): the loss subtracts entropy_coef x the policy's token entropy
    -Σ_v p(v) log p(v) (at the sampling temperature, full vocabulary) summed over the kept response tokens and
    normalised as the policy loss, against the collapse that leaves every group uniform. Set, every group is
    trained (skip_uniform_groups no longer holds: a uniform group's entropy term has a gradient). Start small:
    on SmolLM2's 49,152-id vocabulary 0.01 drove the token entropy from ~2 to 10.5 nats (uniform) in 60 steps and
    the reward to 0 (BENCHMARKS.md, run J)."""
    entropy_target: float | None = Field(None, gt=0)
    """With entropy_coef: the bonus's weight becomes entropy_coef x max(0, 1 - H / entropy_target), H the
    micro-batch's mean token entropy (nats, no gradient): nothing while the policy's entropy is above the target,
    more the further it falls below (a proportional control toward a target entropy, as Skywork-OR1's adaptive
    entropy control), so the bonus cannot push the entropy past the target. Logged as rl/entropy_coef."""
    skip_uniform_groups: bool = True
    """Leave groups whose rewards are all equal (every advantage 0) out of the trainer's forward and backward:
    every term of the GRPO loss is multiplied by the advantage, so they add nothing to the gradient and the
    step's gradient is the same for less compute (the token normaliser still counts them). Applies only where
    that holds: a GRPO stage (not OPD) with kl_ref_coef 0, entropy_coef 0 and dense attention (the sparse indexer's loss sees
    every sample); each worker still trains at least one group. Their rollout/ metrics still count them; the step's
    rl/ and train/ metrics (clip fraction, ratio, tokens/s) cover the groups it computed. Logged as
    train/uniform_groups_skipped_total."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): a group whose rewards all come out equal (within each
    of its effort groups) is dropped as soon as its rewards are in (the prompt's outcome `filtered` in the store;
    logged as dispatch/filtered_groups), and a train step waits for prompts_per_step groups with a reward spread, so
    every step trains a full batch of groups with a gradient. Rollouts keep being spent on the dropped groups; what
    it saves is the train steps' fixed costs (a launch-bound forward and backward, an interrupt, a weight update)
    for groups that had nothing to teach, at the price of fewer optimizer steps. Uniform groups are dropped even
    where they would have a gradient (kl_ref_coef, entropy_coef). GRPO stages only."""
    routing_replay: bool = True
    """MoE: the training forward uses the expert ids recorded at rollout, concatenated over segments
    (seed §5.2.1); gate weights still come from the current router."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass (replayed routing is reused, not re-drawn)."""

    @model_validator(mode="after")
    def _entropy_target_needs_a_bonus(self) -> "GRPOStage":
        if self.entropy_target is not None and self.entropy_coef == 0:
            raise ValueError("entropy_target needs entropy_coef > 0 (the bonus it scales)")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_on_grpo_only(self) -> "GRPOStage":
        if self.dynamic_sampling and self.type == "opd":
            raise ValueError("dynamic_sampling drops groups whose rewards are equal; an OPD stage's teacher signal is "
                             "in every group (a GRPO-stage field)")
        return self


class OPDStage(GRPOStage):
    """On-policy distillation (seed §5.2.4) on the asynchronous runtime: the student samples, each
    sample's dataset teacher scores every response position, and the loss is the full-vocabulary
    reverse KL  Σ_v π_s(v) (log π_s(v) − log π_t(v)), optionally mixed with the GRPO loss."""

    type: Literal["opd"] = "opd"  # type: ignore[assignment]
    """Discriminator: an OPD stage (every GRPO field applies: dispatch, staleness, clipping)."""
    teachers: TeacherPoolConfig
    """The teachers (checkpoints, the datasets each scores) and the device pool that serves them."""
    kl_weight: float = Field(1.0, ge=0)
    """Weight of the reverse-KL term (per response token, normalised like the GRPO loss)."""
    rl_weight: float = Field(0.0, ge=0)
    """Weight of the GRPO term on verifier rewards (0: pure distillation)."""
    kl_chunk_size: int = Field(256, gt=0)
    """Response positions per chunk of the KL: no [tokens, vocab] float32 tensor for the batch."""
    kl_impl: Literal["auto", "triton", "torch"] = "auto"
    """Fused Triton kernel (auto: on CUDA) or the chunked PyTorch path."""

    @field_validator("teachers", mode="before")
    @classmethod
    def _teacher_runs(cls, v):
        """A teacher `checkpoint: RUN_DIR[:STEP]` (a trained run) is its newest (or step STEP's) checkpoint."""
        from rl.checkpoint.run_specs import resolve_teacher_runs

        return {**v, "teachers": resolve_teacher_runs(v.get("teachers"))} if isinstance(v, dict) else v


Stage = Annotated[Union[SFTStage, OPDStage, GRPOStage], Field(discriminator="type")]


class RuntimeConfig(StrictConfig):
    """Placement: Ray actors (one PolicyWorker per device, CPU reward workers) or in-process."""

    ray: bool = True
    """Run workers as Ray actors; false runs one PolicyWorker in the driver process (debugging)."""
    ray_address: str | None = None
    """Join this Ray cluster ('auto' or host:port); default: start a Ray of the job's own, even where RAY_ADDRESS is
    set or another cluster was `ray start`ed on this machine (a bare `ray.init()` would join that one)."""
    num_cpus: int | None = Field(None, gt=0)
    """CPUs of a locally started Ray (default: all)."""
    num_workers: int = Field(1, gt=0)
    """PolicyWorkers, one per device; more than one trains data-parallel (gloo on CPU, NCCL on GPU)."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How num_workers > 1 train (rl/train/parallel.py). ddp: every worker holds the whole trainer; gradients are
    summed in buckets during the backward (DistributedDataParallel). fsdp2: parameters, gradients and AdamW
    state sharded over the workers (fully_shard per decoder layer), for a policy whose trainer does not fit
    one device; the engines still hold full weights. One worker trains unsharded either way."""
    cpus_per_worker: float = Field(1.0, ge=0)
    """Ray CPU resource of each PolicyWorker."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the workers' placement group (one bundle per worker: 1 GPU + cpus_per_worker CPUs; rl/runtime/placement.py) lies
    over the nodes: PACK (default) as few nodes as possible; SPREAD as many as possible; STRICT_PACK one node or
    fail; STRICT_SPREAD one worker per node or fail. A group the cluster cannot hold fails the start in one line."""
    num_reward_workers: int | Literal["auto"] = "auto"
    """CPU actors that verify finished samples (Ray only; in-process runs verify in the driver). auto: one per four
    CPUs of the Ray cluster (runtime.num_cpus when set, else this machine's), at least 1 and at most 8: a 2-core
    machine keeps one, a 16-core GPU host gets four, so verdicts keep up with the engines (issue #41)."""

    @field_validator("num_reward_workers")
    @classmethod
    def _positive_workers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError(f"num_reward_workers must be a positive number of actors or 'auto', got {v}")
        return v

    def reward_workers(self) -> int:
        """How many reward actors the job starts (`num_reward_workers`, auto resolved on this machine)."""
        if self.num_reward_workers != "auto":
            return self.num_reward_workers
        return max(1, min(8, (self.num_cpus or os.cpu_count() or 1) // 4))
    worker_timeout_s: float = Field(1800.0, gt=0)
    """Longest one call to the workers (a rollout slice, a train step, an evaluation, a checkpoint write) and
    one collective between them may take. A worker that has not answered by then is declared hung, one
    that died is named at once: the job stops with one line naming the worker and the phase (exit 4) and
    `rl resume` continues from the newest checkpoint (rl/runtime/groups.py)."""
    worker_start_timeout_s: float = Field(600.0, gt=0)
    """Longest the workers' start may take: building each worker (imports, the model and its checkpoint
    loaded) and the first calls (rendezvous, process group). Separate from worker_timeout_s so that a short
    hang timeout does not fail a slow start (a large model, a loaded machine)."""


class SandboxConfig(StrictConfig):
    """Where tool calls (`tools:`) and verifiers that run code (`VerifyContext.code`, rl/runtime/code_runner.py) run: a
    sandbox server of each node (sandbox_client/), one the job starts itself or one started apart."""

    socket: Literal["auto"] | Path | None = None
    """`auto`: `rl train` starts a sandbox server on every node its workers run on and stops it when the job ends
    (rl/runtime/sandbox_nodes.py); a path: the Unix socket of a server started apart (`rl sandbox serve --socket PATH`,
    which many jobs may share); None (default): `auto` when the recipe has tools, else no sandbox (verifiers get
    no code runner)."""
    limits: Limits = Field(default_factory=Limits)
    """Per-run limits: memory_mib, cpu_s, max_processes, timeout_s, output_bytes, file_mib, snapshot_mib, disk_mib,
    disk_inodes."""
    backend: Literal["bwrap", "process"] = "bwrap"
    """Isolation of the servers the job starts (`auto`): bwrap (namespaces + cgroups, strong) or process
    (rlimits only, weak: for machines without user namespaces). A server started apart has its own."""
    warm_interpreter: bool = True
    """Servers the job starts (`auto`) run a sandbox's Python tool calls (`python3 -c`) in children forked from one
    warm interpreter per sandbox, started at its first call through the same backend, cgroups, uid and limits, and
    killed with its whole tree at any limit (sandbox_client/warm.py): each call still starts from a fresh
    interpreter's state, and costs a fork instead of a process chain and an interpreter start-up (on a 2-core CPU,
    bwrap: 1.8x the calls/s of 3-call samples, 3.1x of 8-call ones; process backend 1.3x and 2.4x; BENCHMARKS.md).
    false: every call spawns, as before. A server started apart: `rl sandbox serve --no-warm-interpreter`."""
    max_sandboxes: int | None = Field(None, ge=1, le=65536)
    """Admission limit of each server the job starts (`auto`): sandboxes open at once on a node; a sample past
    it waits with backoff (its KV kept). None: one for every sample the engines may hold at once
    (`engine.max_batch_size` x `runtime.num_workers`, `Recipe.sandbox_slots`): a sample keeps its sandbox from its
    first call to its end, so a lower limit caps the samples in flight (issue #43's tool-use specialist on an H200:
    32 of 256 in flight, 40-68 s a GRPO step)."""

    @field_validator("socket")
    @classmethod
    def _listening(cls, p: Path | str | None) -> Path | str | None:
        import stat

        if isinstance(p, Path) and not (p.exists() and stat.S_ISSOCK(p.stat().st_mode)):
            raise ValueError(f"{str(p)!r} is not a socket: start the node's server first (rl sandbox serve --socket {p}), "
                             "or say `auto` to have the job start one")
        return p


class ToolDefinition(StrictConfig):
    """One tool the policy may call (rollout/tool_calls.py); it runs in the sample's sandbox."""

    name: str
    """The name the model calls it by (letters, digits, '_', '-', '.'; starting with a letter or '_')."""
    description: str = ""
    """What the prompt tells the model the tool does."""
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(PYTHON_TOOL.parameters))
    """JSON schema (type: object) of the arguments; a call is checked against it (required keys, JSON types,
    enums, additionalProperties: false) before it runs. Default: one required string `code`."""
    run: Literal["python", "shell"] = "python"
    """python: run the call's `code` argument with python3; shell: its `command` argument with /bin/sh. The
    schema must declare that argument as a required string."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError(f"{v!r} is not a tool name: letters, digits, '_', '-', '.', starting with a letter or '_'")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_parameters_schema(v)
        return v

    @model_validator(mode="after")
    def _runs_an_argument(self) -> "ToolDefinition":
        key = RUN_ARGUMENT[self.run]
        prop = self.parameters.get("properties", {}).get(key)
        if prop is None or prop.get("type") != "string" or key not in self.parameters.get("required", []):
            raise ValueError(f"a `run: {self.run}` tool runs its {key!r} argument: parameters must declare {key!r} "
                             f"as a required string property")
        return self

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters, self.run)


class ToolsConfig(StrictConfig):
    """Multi-turn tool calls (issue #16): the policy may stop at a call in `format`, the call runs in the
    sample's sandbox (`sandbox.socket`), its output is appended (loss mask 0) and generation continues."""

    format: Literal["hermes", "code"] = "hermes"
    """hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen/Hermes); code: a fenced
    ```python block runs with the python tool (rollout/tool_calls.py documents both)."""
    definitions: list[ToolDefinition] = Field(default_factory=list)
    """The tools, declared in the system prompt. The code format calls its one python tool (default: a
    built-in `python`); hermes needs at least one."""
    instructions: str | None = None
    """The text that declares the tools in every prompt's system prompt, replacing the format's own wording
    (rollout/tool_calls.tool_instructions); e.g. a one-line instruction for a small model. None: the format's."""
    max_turns: int = Field(4, gt=0)
    """Tool calls per sample at most; a sample that calls past it ends there."""
    max_tool_output_tokens: int = Field(256, gt=0)
    """Tokens of one tool output the model sees; longer output is cut, the cut marked and recorded."""
    max_total_tokens: int | None = Field(None, gt=0)
    """Response tokens per sample at most, tool output included; None: engine.max_new_tokens."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock seconds of one call; at most sandbox.limits.timeout_s, which the server enforces."""
    datasets: list[str] | None = Field(None, min_length=1)
    """The datasets whose prompts declare the tools and whose samples may call them (a multi-domain run where one
    domain uses tools: the others' prompts stay as their own runs saw them); None: every dataset."""
    on_failure: Literal["zero_reward", "leave_loss"] = "zero_reward"
    """Repercussion (seed §5.1.3; rl/algo/repercussion.py): a call whose sandbox failed (timeout, memory, cpu, processes,
    output_truncated, crashed, refused after admission retries, sandbox_error) ends its sample, failed, with the
    reason in the store (`samples.failure`) and `rollout/tool_failures/<reason>` counts per step. zero_reward: the
    sample gets reward 0 and trains with it, inside its group's baseline; leave_loss: the sample leaves the step
    (no token of it in the loss or its normaliser) and its group's baseline (mean, std) is taken over the
    group's other samples. The job never stops for it."""

    @model_validator(mode="after")
    def _usable_definitions(self) -> "ToolsConfig":
        names = [d.name for d in self.definitions]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if self.format == "hermes" and not self.definitions:
            raise ValueError("the hermes format needs at least one tool in definitions")
        if self.format == "code" and (len(self.definitions) > 1 or any(d.run != "python" for d in self.definitions)):
            raise ValueError("the code format calls one python tool: definitions may hold at most one, with run: python")
        return self

    def specs(self) -> tuple[ToolSpec, ...]:
        """The tools as rollout/tool_calls.py takes them (code format without definitions: the built-in python)."""
        return tuple(d.spec() for d in self.definitions) or (PYTHON_TOOL,)

    def declared(self) -> tuple[str, tuple[ToolSpec, ...], str | None]:
        """(format, specs, instructions): what the prompts declare (rl/rendering.Renderer.tools)."""
        return self.format, self.specs(), self.instructions


class EvalConfig(StrictConfig):
    """Held-out evaluation: greedy decoding on each dataset's held-out split."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature at evaluation (0: greedy)."""
    max_problems: int | None = Field(None, gt=0)
    """Evaluate at most this many held-out problems per dataset (default: all)."""
    datasets: list[str] | None = Field(None, min_length=1)
    """Evaluate these datasets' held-out problems (names in `datasets:`); None: every dataset's. Two datasets that
    split one file between stages share a held-out file: evaluate it once."""
    before_training: bool = False
    """Also evaluate the initial policy before the first stage (logged at step 0, `init_acc` in the
    RESULT line), with the same generation budget as every later evaluation (verl's val_before_train)."""


class StoreConfig(StrictConfig):
    """Trajectory store."""

    url: str | None = None
    """SQLAlchemy URL; default sqlite:///<run_dir>/trajectories.db (WAL mode). Many runs may share one
    database, e.g. postgresql+psycopg://user@host/asyncrl (rl/store/trajectories.py)."""


class CheckpointConfig(StrictConfig):
    """Resumable checkpoints (seed §5.1.2, §5.2.3): see rl/checkpoint/format.py for what one holds."""

    every_steps: int = Field(0, ge=0)
    """Write one every N train steps (counted over all stages); 0: only at stage ends and on SIGTERM."""
    keep_last: int = Field(3, gt=0)
    """Keep the newest K checkpoints, and every stage-end one; the others are deleted after a new one is complete."""
    keep_weights: int = Field(0, ge=0)
    """Keep the model weights of the newest N pruned checkpoints in RUN_DIR/weights/<checkpoint name>/ (config.json
    and model.safetensors, moved: no copy; the optimizer state and in-flight samples go; older ones are deleted): a
    model directory that `model.init`, `rl eval --checkpoint` and an OPD teacher read. For teachers from earlier
    steps of a run (seed §5.2.4) at the disk cost of the weights alone. 0: none kept."""
    background: bool = True
    """Periodic checkpoints copy the state into host memory at the token boundary and write their files on a thread of
    each worker while training goes on; the checkpoint is committed (manifest, rename) at the first train step after
    every write is done, and before the next checkpoint. Stage-end and preemption checkpoints are written in place.
    A crash before the commit leaves the previous checkpoint as the newest, as a crash inside a write does. Costs host
    memory for one copy of the weights and optimizer state (rank 0) while a write runs."""


class LoggingConfig(StrictConfig):
    """Metrics sinks: always a JSONL file in the run directory; wandb when installed and enabled."""

    wandb: bool = True
    """Log to wandb (offline mode unless wandb_mode says otherwise); skipped when wandb is absent."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline needs no network and writes under <run_dir>/wandb."""
    project: str = "asyncrl"
    """wandb project name."""
    progress_bar: bool = True
    """Console progress bar per stage."""


class Recipe(StrictConfig):
    """Root of a training recipe."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity, seed and device."""
    tokenizer: TokenizerConfig = Field(default_factory=CharTokenizerConfig)
    """Tokenizer, chosen by `type`: `char` (the character-level tokenizer of the synthetic tasks) or `hf`
    (a Hugging Face directory or .gguf file; `path: null` takes model.init's)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy architecture."""
    datasets: list[DatasetConfig] = Field(min_length=1)
    """Procedural task datasets (each `type:` a task family)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """Rollout engine."""
    effort: EffortConfig | None = None
    """Effort conditioning (seed §5.1.4): prompt prefix, per-level subgroups, length penalty."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Where workers run (Ray or in-process) and how many."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Code execution for tools and verifiers: each node's sandbox server (started by the job or apart), limits."""
    tools: ToolsConfig | None = None
    """Multi-turn tool calls in rollouts (format, tools, limits), run on the node's sandbox server. None: single-turn."""
    stages: list[Stage] = Field(min_length=1)
    """Training stages, run in order (e.g. sft then grpo)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation after each stage."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """Trajectory store."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics logging."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Resumable checkpoints: how often, how many kept."""

    @property
    def sandbox_server(self) -> Literal["auto", "apart"] | None:
        """Whose sandbox servers the job uses: `auto` (it starts one per node), `apart` (sandbox.socket names one
        started apart), or None (no sandbox: no tools, no socket)."""
        socket = self.sandbox.socket
        if socket is None:
            return "auto" if self.tools is not None else None
        return "auto" if socket == "auto" else "apart"

    @property
    def max_response_tokens(self) -> int:
        """A sample's response budget: tools.max_total_tokens (tool output included) or engine.max_new_tokens."""
        if self.tools is not None and self.tools.max_total_tokens is not None:
            return self.tools.max_total_tokens
        return self.engine.max_new_tokens

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer_by_name(cls, v):
        return {"type": v} if isinstance(v, str) else v  # `tokenizer: char`, as recipes before the union said

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_of_model_init(cls, data):
        """`tokenizer: {type: hf, path: null}` means the tokenizer of the checkpoint `model.init` names."""
        if not isinstance(data, dict):
            return data
        tok = data.get("tokenizer")
        tok = {"type": tok} if isinstance(tok, str) else tok.model_dump() if isinstance(tok, HFTokenizerConfig) else tok
        if isinstance(tok, dict) and tok.get("type") == "hf" and tok.get("path") is None:
            model = data.get("model")
            init = model.get("init") if isinstance(model, dict) else getattr(model, "init", None)
            if init is not None:
                data = {**data, "tokenizer": {**tok, "path": str(init)}}
        return data

    def compile_mode(self) -> str | None:
        """`run.compile` resolved: "layers", "ops" or None (eager)."""
        mode = self.run.compile
        if mode == "auto":
            fsdp = self.runtime.parallel == "fsdp2" and self.runtime.num_workers > 1
            mode = "layers" if self.run.device == "cuda" and self.run.dtype == "bfloat16" and not fsdp else "off"
        return None if mode == "off" else mode

    @model_validator(mode="after")
    def _compile_not_under_fsdp2(self) -> "Recipe":
        if self.run.compile in ("layers", "ops") and self.runtime.parallel == "fsdp2" and self.runtime.num_workers > 1:
            raise ValueError(f"run.compile {self.run.compile} with runtime.parallel fsdp2 is not supported (compiled "
                             "layers under fully_shard are untried here): use run.compile off or auto")
        return self

    @model_validator(mode="after")
    def validate_vocab(self) -> "Recipe":
        """char: model.vocab_size equals the tokenizer's ids. hf: the tokenizer's ids (highest id + 1, added tokens
        and every special id included) fit in model.vocab_size: checkpoints often pad the embedding (e.g. to a
        multiple of 64), and the extra rows are ids that no text encodes to and that decode to nothing."""
        tok = self.tokenizer.build()
        vocab = tok.vocab_size
        if self.tokenizer.type == "char" and self.model.vocab_size != vocab:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} but the {self.tokenizer.type} tokenizer has {vocab} ids")
        if self.model.vocab_size < vocab:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is smaller than the {self.tokenizer.type} tokenizer's "
                             f"{vocab} ids ({self.tokenizer.path}): the embedding needs a row for every id")
        chat = [d for d in self.datasets if getattr(d, "chat", False) or getattr(d, "messages", None)]
        if chat:  # render one conversation now: a template that raises fails here, not minutes into the job
            system = [{"role": "system", "content": chat[0].system}] if getattr(chat[0], "system", None) else []
            tok.apply_chat_template([*system, {"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True)
        return self

    @model_validator(mode="after")
    def validate_lengths(self) -> "Recipe":
        if self.engine.max_seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"engine.max_seq_len={self.engine.max_seq_len} exceeds model.max_position_embeddings={self.model.max_position_embeddings}"
            )
        if self.engine.prefill_chunk_tokens is not None and self.model.is_sparse:
            raise ValueError("engine.prefill_chunk_tokens: chunked prefill feeds chunks over a paged KV cache; this model "
                             "attends through CSA2 (model.sparse_attention), whose caches take whole prompts")
        return self

    @model_validator(mode="after")
    def validate_init_checkpoint(self) -> "Recipe":
        ckpt = self.run.init_checkpoint
        if ckpt is not None:
            config_file = ckpt / "config.json"
            if not config_file.is_file():
                raise ValueError(f"run.init_checkpoint {str(ckpt)!r} has no config.json")
            theirs = ModelConfig.model_validate_json(config_file.read_text())
            if diff := weight_differences(theirs, self.model):  # the KV-cache format may differ (e.g. a QAT fine-tune)
                raise ValueError(f"run.init_checkpoint {str(ckpt)!r} was saved with a different model (differs in: {', '.join(diff)})")
        return self

    def sandbox_slots(self) -> int:
        """`sandbox.max_sandboxes`, or one sandbox for every sample the engines may hold at once."""
        return self.sandbox.max_sandboxes or min(65536, self.engine.max_batch_size * self.runtime.num_workers)

    def tool_datasets(self) -> frozenset[str] | None:
        """The datasets that use the tools (`tools.datasets`; None: every one, or no tools)."""
        return frozenset(self.tools.datasets) if self.tools is not None and self.tools.datasets is not None else None

    @model_validator(mode="after")
    def validate_dataset_names(self) -> "Recipe":
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names must be unique, got {names}")
        for where, chosen in [(f"stages.{i}.datasets", s.datasets) for i, s in enumerate(self.stages)] + [
                ("eval.datasets", self.eval.datasets), ("tools.datasets", self.tools.datasets if self.tools else None)]:
            unknown = sorted(set(chosen or ()) - set(names))
            if unknown:
                raise ValueError(f"{where} names unknown datasets {unknown}; datasets are {names}")
        for i, stage in enumerate(self.stages):
            if isinstance(stage, GRPOStage):
                own = self.stage_datasets(stage)
                unknown = sorted((set(stage.dispatch.dataset_max_inflight) | set(stage.dispatch.mixture)) - set(own))
                if unknown:
                    raise ValueError(f"stages.{i}.dispatch names unknown datasets {unknown}; the stage's datasets are {own}")
        return self

    def stage_datasets(self, stage: "SFTStage | GRPOStage") -> list[str]:
        """The names of the datasets a stage draws from, in recipe order."""
        return [d.name for d in self.datasets if stage.datasets is None or d.name in stage.datasets]

    def datasets_of_rl_stages(self) -> list[str]:
        """The names of the datasets some GRPO or OPD stage draws from (what a live patch may name), in recipe order."""
        used = {d for s in self.stages if isinstance(s, GRPOStage) for d in self.stage_datasets(s)}
        return [d.name for d in self.datasets if d.name in used]

    def eval_datasets(self) -> list[str]:
        """The names of the datasets whose held-out problems are evaluated, in recipe order."""
        return [d.name for d in self.datasets if self.eval.datasets is None or d.name in self.eval.datasets]

    @model_validator(mode="after")
    def validate_teachers(self) -> "Recipe":
        for i, stage in enumerate(self.stages):
            if isinstance(stage, OPDStage):
                names = self.stage_datasets(stage)
                pool = stage.teachers
                for t in pool.teachers:
                    unknown = sorted(set(t.datasets) - set(names))
                    if unknown:
                        raise ValueError(f"stages.{i}.teachers: teacher {t.name!r} serves unknown datasets {unknown}; "
                                         f"the stage's datasets are {names}")
                unserved = [d for d in names if pool.teacher_for(d) is None]
                if unserved and stage.kl_weight > 0:
                    raise ValueError(f"stages.{i}.teachers: no teacher serves datasets {unserved}")
                pool.validate_vocab(self.model.vocab_size)  # reads each teacher's config.json
        return self

    @model_validator(mode="after")
    def validate_lora(self) -> "Recipe":
        if self.model.lora is not None and self.runtime.parallel == "fsdp2" and self.runtime.num_workers > 1:
            raise ValueError("model.lora with runtime.parallel: fsdp2 is not supported: the frozen base is not sharded "
                             "and the adapters are small: use runtime.parallel: ddp")
        return self

    @model_validator(mode="after")
    def validate_effort(self) -> "Recipe":
        if self.effort is not None:
            for i, stage in enumerate(self.stages):
                if isinstance(stage, GRPOStage) and stage.group_size != self.effort.group_size:
                    raise ValueError(
                        f"stages.{i}.group_size={stage.group_size} must equal len(effort.levels) x "
                        f"effort.samples_per_level = {self.effort.group_size}")
                if isinstance(stage, SFTStage) and stage.effort_cold_start:
                    plain = [d.name for d in self.datasets if d.name in self.stage_datasets(stage)
                             and hasattr(d, "direct_demonstration") and d.direct_demonstration is None]
                    if plain:
                        raise ValueError(
                            f"stages.{i}.effort_cold_start: file datasets {plain} name no direct_demonstration (the "
                            f"answer without its reasoning, e.g. \"The answer is {{answer}}.\"), so their demonstrations "
                            f"could not follow the level")
        return self

    @model_validator(mode="after")
    def validate_inflight(self) -> "Recipe":
        for i, stage in enumerate(self.stages):
            if isinstance(stage, GRPOStage):
                if stage.prompts_per_step < self.runtime.num_workers:
                    raise ValueError(f"stages.{i}.prompts_per_step={stage.prompts_per_step} is below runtime.num_workers="
                                     f"{self.runtime.num_workers}: every worker trains on whole groups")
                if stage.dispatch.max_inflight < stage.group_size:
                    raise ValueError(f"stages.{i}.dispatch.max_inflight={stage.dispatch.max_inflight} is below group_size={stage.group_size}")
                step_samples = stage.prompts_per_step * stage.group_size
                if stage.dispatch.policy in ("sample", "prompt") and stage.dispatch.max_inflight < step_samples:
                    # these policies count completed groups that wait for the step as in flight: below one
                    # step's samples the step never fills and the rollout stalls
                    raise ValueError(f"stages.{i}.dispatch.max_inflight={stage.dispatch.max_inflight} is below one train "
                                     f"step's samples (prompts_per_step={stage.prompts_per_step} x group_size="
                                     f"{stage.group_size} = {step_samples}), which the {stage.dispatch.policy!r} policy "
                                     f"holds in flight until the step: raise max_inflight or lower prompts_per_step")
                if self.engine.max_batch_size * self.runtime.num_workers < stage.dispatch.max_inflight:
                    raise ValueError(
                        f"stages.{i}.dispatch.max_inflight={stage.dispatch.max_inflight} exceeds what the engines decode at once "
                        f"(engine.max_batch_size={self.engine.max_batch_size} x runtime.num_workers={self.runtime.num_workers})")
        return self

    @model_validator(mode="after")
    def validate_tools(self) -> "Recipe":
        if self.tools is None:
            return self
        if self.tools.timeout_s > self.sandbox.limits.timeout_s:
            raise ValueError(f"tools.timeout_s={self.tools.timeout_s} exceeds sandbox.limits.timeout_s="
                             f"{self.sandbox.limits.timeout_s}, which the server enforces")
        total = self.tools.max_total_tokens
        if total is not None and total >= self.engine.max_seq_len:
            raise ValueError(f"tools.max_total_tokens={total} leaves no room for a prompt in engine.max_seq_len="
                             f"{self.engine.max_seq_len}")
        # a chat template that cannot render a tool message fails here, not at the first call minutes in
        tool_result_tokens(self.tokenizer.build(), "0", max_tokens=self.tools.max_tool_output_tokens)
        return self

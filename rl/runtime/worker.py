"""PolicyWorker: the engine and the trainer of one device, sharing one policy module (seed §5.2.1).

Phases alternate on the same device: ROLLOUT (`add_requests`, `rollout`) → `interrupt` (every in-flight
sample stops at the token boundary; its `RolloutState` leaves the pool, its KV parked as `engine.park_kv`
says) → TRAIN (`train_step` with the stage's objective; the weights change in place) → `update_weights`
(version + 1) → `resume` (the states go back into the KV pool; no prefill) → ROLLOUT. Checkpoints: `save` / `load` /
`load_inflight`. The class is plain Python with this small public API; `rl.runtime.groups.PolicyGroup` calls it
on every worker, in-process or as Ray actors. Several workers train data-parallel through `rl.train.parallel`
(DDP or FSDP2, `runtime.parallel`); under FSDP2 the trainer holds shards and the engine its own full copy.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from model.checkpoint import BASE_FILE, synced_entry, write_weights
from model.decoder import Decoder, is_dtensor
from model.lora import base_to, has_lora, lora_layers, merged_copy, merged_weight, is_adapter
from model.pretrained import build_decoder, load_pretrained_into
from rl.checkpoint.host_copies import HostCopies
from rl.config import GRPOStage, OPDStage, Recipe, SFTStage
from rl.faults import fault_point
from rl.train.objectives import build_objective
from rl.train.parallel import Single, build_data_parallel, trainer_state_bytes
from rl.runtime.placement import node_ip
from rl.runtime.tool_turns import ToolTurns, generate_with_tools
from rl.train.trainer import StepMetrics, TrainBatch, Trainer
from rollout.engine import Engine
from teachers.config import TeacherSpec
from teachers.pool import TeacherPool
from rollout.types import (Generation, GenerationRequest, RolloutState, parts_nbytes, states_file_parts,
                           states_on_host, unpack_plain)


@dataclass
class StepResult:
    finished: list[Generation]
    active: int
    """Sequences generating after this call."""
    waiting: int
    """Requests queued for admission after this call."""
    steps: int
    """Engine steps run."""
    generated: int = 0
    """Tokens generated in this call."""
    finish_step: list[int] = field(default_factory=list)
    """For each finished sequence, the index (within this call) of the engine step that finished it."""
    oldest_versions: list[int] = field(default_factory=list)
    """Version of the oldest generated token of every active sequence that has one."""
    seconds: float = 0.0
    """Wall time of the call on the worker (its engine steps, tool service): the rest of a rollout phase is
    the controller's (dispatch, rewards, the store) and the round trip."""
    prefill_calls: int = 0
    """Prefill forwards the engine ran in this call (one per admission of new prompts)."""
    parked: int = 0
    """Samples waiting with their KV out of the pool after this call (parked under memory pressure)."""
    parks: int = 0
    """Samples parked during this call because the KV pool ran dry (rollout/engine.py `_grow`)."""
    parked_bytes: int = 0
    """Bytes of KV those parks copied to host memory."""
    kv_used_frac: float = 0.0
    """Tokens held in the KV pool over its capacity, after this call."""
    reprefill_tokens: int = 0
    """Generated tokens prefilled again in this call's parks (past `engine.park_host_gib`)."""
    gap_s: float = 0.0
    """Seconds the worker waited for this call since its previous rollout call ended, when no other call came between
    (an interrupt, a train step or an evaluation starts the count again): on a pipelined actor, time the next call
    was not queued yet (the controller still handled the one before) and Ray's own handling of the call; in-process,
    the controller's handling of the previous call's results."""


def build_policy(recipe: Recipe, read_weights: bool = True) -> Decoder:
    """The run's initial policy on its device: `model.init`'s weights (a pretrained checkpoint, streamed in),
    else a random initialisation from the run seed; then `run.init_checkpoint`'s weights when given.
    `read_weights=False`: neither file is read (the parameters are allocated; `initial_weights` names the
    file that `PolicyWorker.join_process_group` reads once the trainer is sharded)."""
    torch.manual_seed(recipe.run.seed)
    model = build_decoder(recipe.model, device=recipe.run.device, read_weights=read_weights)
    if recipe.run.init_checkpoint is not None and read_weights:  # the KV format may differ (QAT)
        load_pretrained_into(model, recipe.run.init_checkpoint)  # every tensor checked: one line (model/pretrained.py)
    return model


def initial_weights(recipe: Recipe) -> Path | None:
    """The checkpoint holding every initial weight: run.init_checkpoint (written over model.init's), else
    model.init's; None: a random initialisation."""
    from model.registry import resolve_model_source

    if recipe.run.init_checkpoint is not None:
        return Path(recipe.run.init_checkpoint)
    return None if recipe.model.init is None else Path(resolve_model_source(recipe.model.init))


def interface_of(ip: str) -> str | None:
    """The network interface that holds address `ip` on this host (psutil, which Ray brings), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return None


def rollout_copy(model: Decoder, dtype: torch.dtype) -> Decoder:
    """A copy of `model` with its parameters in `dtype` (buffers, e.g. the MoE selection bias, keep theirs)
    for the engine, without gradients; `refresh_rollout_copy` updates it in place. With LoRA adapters, a plain model
    holding the merged weights (model/lora.py `merged_copy`)."""

    twin = (merged_copy(model) if has_lora(model) else copy.deepcopy(model)).requires_grad_(False).eval()
    for p in twin.parameters():
        p.data = p.data.to(dtype)
    return twin


@torch.no_grad()
def refresh_rollout_copy(twin: Decoder, model: Decoder, frozen: bool = True) -> None:
    """The master weights cast into the copy's existing tensors: the addresses do not change, so the engine's
    captured CUDA graphs stay valid (seed §5.2.1: the weight update happens in place on the device). A
    sharded (FSDP2) parameter is gathered on the device first, one at a time, on every rank together.
    With LoRA, an adapted layer's weight is W + s · B A recomputed from the untouched base (no drift); `frozen=False`
    (after an optimizer step) skips the frozen parameters, which did not change."""
    dst = dict(twin.named_parameters())
    adapted = {f"{name}.weight": layer for name, layer in lora_layers(model).items()}
    for name, src in model.named_parameters():
        if name in adapted:
            dst[name].copy_(merged_weight(adapted[name]))
        elif not is_adapter(name) and (frozen or src.requires_grad):
            dst[name].copy_(src.full_tensor() if is_dtensor(src) else src)
    for d, b in zip(twin.buffers(), model.buffers()):
        d.copy_(b)


class _Writer(threading.Thread):
    """Runs one checkpoint write; `join` raises what it raised."""

    def __init__(self, write):
        super().__init__(name="checkpoint-writer", daemon=True)
        self.write, self.error, self.result = write, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.write()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of join
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


class PolicyWorker:
    def __init__(self, recipe: Recipe, *, rank: int = 0, world_size: int = 1, num_threads: int | None = None):
        """World size > 1: `join_process_group` before the first train step (rl/runtime/groups.py calls it)."""
        self.recipe, self.rank, self.world_size = recipe, rank, world_size
        fault_point("worker_init", rank)
        torch.set_num_threads(num_threads or recipe.run.num_threads)
        sharded = recipe.runtime.parallel == "fsdp2" and world_size > 1
        self._weights_unread = sharded and initial_weights(recipe) is not None
        """FSDP2 with initial weights from a file: each rank reads its rows of it once sharded (`join_process_group`)."""
        self.model = build_policy(recipe, read_weights=not self._weights_unread)  # same seed on every rank
        self._lora_base = initial_weights(recipe) if recipe.model.lora is not None else None
        """The file a LoRA run's frozen base was read from: its checkpoints hold the adapters and this file's identity
        (model/checkpoint.py `BASE_FILE`); None: every weight is written (no LoRA, or a random base)."""
        # the engine decodes with its own copy of the float32 master weights under run.dtype bfloat16 (a bf16 copy)
        # and under FSDP2 (the trainer's parameters become shards) and with LoRA (the engine reads weights, never a
        # layer's forward: it decodes the merged W + s · B A); else it shares the trainer's module
        bf16 = recipe.run.dtype == "bfloat16"
        if bf16 and has_lora(self.model):  # the frozen base in bf16, no float32 master copy (model/lora.py base_to)
            base_to(self.model, torch.bfloat16)
        self.rollout_model = (rollout_copy(self.model, torch.bfloat16 if bf16 else torch.float32)
                              if bf16 or sharded or has_lora(self.model) else self.model)
        self.model.compile_for_training(recipe.compile_mode())  # the training forward only (model/compile.py)
        self.parallel: Single = Single(self.model)
        """The trainer's data-parallel strategy (rl/train/parallel.py); set by `join_process_group`."""
        tok = recipe.tokenizer.build()
        self.engine = Engine(self.rollout_model, recipe.engine, eos_id=tok.eos_id, eos_ids=tok.eos_ids,
                             device=recipe.run.device)
        self.tools = ToolTurns.from_recipe(recipe, tok)  # multi-turn tool calls (rl/runtime/tool_turns.py), or None
        if self.tools is not None:
            self.tools.attach(self.engine)
        self.trainer: Trainer | None = None
        self.pool: TeacherPool | None = None  # OPD stages: the teachers (teachers/pool.py)
        self.reference: Decoder | None = None  # the run's initial policy, frozen (stages with kl_ref_coef > 0)
        self._held: list[RolloutState] = []  # in-flight states parked during TRAIN (KV: `engine.park_kv`)
        self._in_place = False  # interrupted with `park_kv: pool`: the engine holds its samples where they are
        self._writer: _Writer | None = None  # a background checkpoint write (`save`)
        self._host_copies = HostCopies()  # its copies of the weights and optimizer state (rl/checkpoint/host_copies.py)
        self._rollout_end: float | None = None  # perf_counter() at the end of the last rollout call (`StepResult.gap_s`)

    # -- data parallel -------------------------------------------------------------------------------
    def rendezvous_address(self) -> str:
        """`tcp://IP:PORT` for the process group, on this worker's node (rank 0's): the node's address as Ray
        knows it, so that ranks on other nodes reach it; a port free on that address now."""
        import socket

        ip = node_ip()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"

    def join_process_group(self, init_method: str) -> None:
        """Join the data-parallel group (NCCL reduces CUDA tensors, gloo CPU ones) over the interface that
        holds this node's Ray address (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise); every
        collective is bounded by runtime.worker_timeout_s, so a rank whose peer hangs fails, never waits forever.
        A process already in the group (several workers of one test process) keeps it. Then the trainer takes
        its strategy; under FSDP2 with initial weights from a file (`initial_weights`), each rank reads only its
        rows of it and the engine's full copy is gathered from the shards."""
        from datetime import timedelta

        iface = interface_of(node_ip())
        if iface is not None:  # gloo and NCCL's bootstrap would take the hostname's address: often 127.0.0.1
            os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        backend = "nccl" if self.recipe.run.device == "cuda" else "gloo"
        if not dist.is_initialized():
            # meeting the others is part of the start (a peer may still be loading its model): the store waits up to
            # runtime.worker_start_timeout_s; collectives after it are bounded by runtime.worker_timeout_s
            from urllib.parse import urlsplit

            where = urlsplit(init_method)
            store = dist.TCPStore(where.hostname, where.port, self.world_size, is_master=self.rank == 0,
                                  timeout=timedelta(seconds=self.recipe.runtime.worker_start_timeout_s))
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.recipe.runtime.worker_timeout_s))
        self.parallel = build_data_parallel(self.recipe.runtime.parallel, self.model,
                                            bf16=self.recipe.run.dtype == "bfloat16")
        if self._weights_unread:  # each rank reads only its rows of the file; the engine's copy gathers them
            load_pretrained_into(self.model, initial_weights(self.recipe))
            refresh_rollout_copy(self.rollout_model, self.model)
            self.rollout_model.refresh_rollout_weights()
            self._weights_unread = False

    # -- ROLLOUT -------------------------------------------------------------------------------------
    def add_requests(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests; the engine admits them as KV blocks allow."""
        self.engine.add(list(requests))

    def rollout(self, num_steps: int = 1, requests: Sequence[GenerationRequest] = ()) -> StepResult:
        """Advance every active sequence by up to `num_steps` tokens (a token boundary after each); `requests`
        are queued first (`add_requests`: one actor call for both)."""
        fault_point("worker_rollout", self.rank)
        t0 = time.perf_counter()
        gap = 0.0 if self._rollout_end is None else t0 - self._rollout_end
        if requests:
            self.add_requests(requests)
        self.rollout_model.eval()
        prefills = self.engine.stats.prefill_calls
        parks, parked_bytes, reprefill = (self.engine.stats.parks, self.engine.stats.parked_bytes,
                                          self.engine.stats.reprefill_tokens)
        finished, finish_step, steps, before = [], [], 0, self.engine.stats.generated_tokens
        for i in range(num_steps):
            if self.tools is not None:  # start calls of new pauses, append finished calls' outputs
                done = self.tools.service(self.engine)
                finished += done
                finish_step += [i] * len(done)
                if self.engine.has_work() and not self.engine.runnable():
                    self.tools.wait(0.05)  # every sample waits for its tool: nothing to decode
                    continue
            if not self.engine.has_work():
                break
            done = self.engine.step()
            if self.tools is not None:
                self.tools.close([g.sample_id for g in done])
            finished += done
            finish_step += [i] * len(done)
            steps += 1
        # samples paused at a tool call are in flight too (the controller must not see a stall)
        result = StepResult(finished, self.engine.num_active + self.engine.num_paused, self.engine.num_waiting, steps,
                            self.engine.stats.generated_tokens - before, finish_step, self.engine.oldest_versions(),
                            time.perf_counter() - t0, self.engine.stats.prefill_calls - prefills, self.engine.num_parked,
                            self.engine.stats.parks - parks, self.engine.stats.parked_bytes - parked_bytes,
                            self.engine.kv_used_frac, self.engine.stats.reprefill_tokens - reprefill, gap)
        self._rollout_end = time.perf_counter()
        return result

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Run requests to completion (evaluation); in-flight samples are parked meanwhile and
        continue afterwards from their exact token."""
        self.rollout_model.eval()
        self._rollout_end = None
        parked = self.engine.interrupt()
        if self.tools is not None:  # the parked samples' sandboxes go back to the node; their files are kept
            self.tools.suspend()
        try:
            return generate_with_tools(self.engine, self.tools, requests)
        finally:
            self.engine.resume(parked)

    # -- phase switches ------------------------------------------------------------------------------
    def interrupt(self) -> dict[str, float]:
        """Stop at the token boundary; every in-flight sample waits, its KV where `engine.park_kv` says (`pool`: in
        place, nothing moved; else copied out and parked here)."""
        t0, self._rollout_end = time.perf_counter(), None
        if self.engine.cfg.park_kv == "pool":
            self._in_place = True
            return {"states": self.engine.pause(), "bytes": 0, "seconds": time.perf_counter() - t0}
        states = self.engine.interrupt()
        self._held.extend(states)
        return {"states": len(states), "bytes": sum(s.nbytes for s in states), "seconds": time.perf_counter() - t0}

    def resume(self) -> dict[str, float]:
        """Continue after `interrupt`: the parked states go back to the engine (their KV is restored at the next
        step); samples kept in the pool just go on."""
        states, self._held = self._held, []
        in_place, self._in_place = self._in_place, False
        if states:
            self.engine.resume(states)
        kept = self.engine.num_active + self.engine.num_paused if in_place else 0
        return {"states": len(states) + kept, "bytes": sum(s.nbytes for s in states)}

    def drop_inflight(self) -> int:
        """Stop and drop every in-flight sample, parked or generating (end of a stage); returns how many."""
        n = len(self.engine.interrupt()) + len(self._held)
        self._held, self._in_place = [], False
        if self.tools is not None:
            self.tools.close_all()
        return n

    def update_weights(self, version: int) -> None:
        """The new weights are in place already (engine and trainer share the module; with run.dtype
        bfloat16 or FSDP2 the engine's copy is refreshed here, from the gathered shards under FSDP2, on every
        rank together): new tokens carry `version` from here on."""
        if self.rollout_model is not self.model:
            refresh_rollout_copy(self.rollout_model, self.model, frozen=False)
        self.rollout_model.refresh_rollout_weights()  # the engine's fused q/k/v, gate/up (model/fused.py), in place
        self.engine.policy_version = version

    # -- TRAIN ---------------------------------------------------------------------------------------
    def begin_stage(self, stage: SFTStage | GRPOStage) -> None:
        self._rollout_end = None
        self.trainer = Trainer(self.model, stage.optim, device=self.recipe.run.device,
                               total_steps=stage.max_steps * getattr(stage, "mini_batches", 1),
                               autocast=torch.bfloat16 if self.recipe.run.dtype == "bfloat16" else None,
                               parallel=self.parallel)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if isinstance(stage, OPDStage):  # teacher weights in host memory, an LRU set on the device
            self.pool = TeacherPool.from_config(stage.teachers, device=self.recipe.run.device)
        if getattr(stage, "kl_ref_coef", 0) > 0 and self.reference is None and has_lora(self.model):
            self.reference = self.model  # the base: the objective turns the adapters off (model/lora.py adapters_off)
        if getattr(stage, "kl_ref_coef", 0) > 0 and self.reference is None:
            # the run's initial policy, rebuilt exactly as the policy was (same seed, same init weights), so a
            # resumed job penalises the KL to the same reference without keeping it in checkpoints
            with torch.random.fork_rng(devices=[]):  # building it must not move the training RNG
                self.reference = build_policy(self.recipe).eval().requires_grad_(False)
        if self.recipe.run.device == "cuda":  # after the reference and the pool: what is left is the trainer's
            self.trainer.token_cap = self._token_cap(stage)

    def _token_cap(self, stage: SFTStage | GRPOStage) -> int:
        """The most tokens a training micro-batch may hold on this device (rl/runtime/memory.py `token_cap`): what is
        free now (the engine's KV pool, the weights, their engine copy and the reference are allocated), less the
        teachers' device budget on an OPD stage (the pool loads them as they are used)."""
        from rl.runtime.memory import activation_bytes_per_token, token_cap

        free, _ = torch.cuda.mem_get_info()
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # the allocator's cache is free to us
        if isinstance(stage, OPDStage):
            free -= stage.teachers.device_memory_mib * 2**20
        rt = self.recipe.runtime
        shards = rt.num_workers if rt.parallel == "fsdp2" and rt.num_workers > 1 else 1
        per_token = activation_bytes_per_token(self.recipe.model, self.recipe.run.dtype == "bfloat16",
                                               getattr(stage, "activation_checkpointing", False))
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # LoRA: the adapters alone
        return token_cap(free, trained // shards, per_token, optimizer_allocated=False)

    def add_teachers(self, specs: Sequence[TeacherSpec]) -> None:
        """Load teachers into this worker's pool, all or none (rl/reconfigure.py: the job validates a patch by loading
        its teachers): a teacher that fails to load (damaged, non-finite, too big) leaves the pool as it was and
        raises ValueError with one line naming it."""
        if self.pool is None:
            raise ValueError("this stage has no teacher pool (not an OPD stage)")
        added = []
        try:
            for spec in specs:
                self.pool.add(spec)
                added.append(spec.name)
        except (ValueError, OSError, RuntimeError, MemoryError) as e:
            self.remove_teachers(added)
            text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(text if text.startswith("teacher ") else f"teacher {spec.name!r}: {text}") from None

    def remove_teachers(self, names: Sequence[str]) -> None:
        """Take teachers out of this worker's pool (those it does not hold are skipped): a refused patch's."""
        for name in names:
            if self.pool is not None and name in self.pool.names:
                self.pool.remove(name)

    def train_step(self, batch: TrainBatch | list[TrainBatch], stage: SFTStage | GRPOStage | OPDStage) -> StepMetrics:
        """One optimizer step on this rank's rows with the stage's objective (rl/train/objectives.py), or one per
        mini-batch of a list (`GRPOStage.mini_batches`); the weights change in place, shared with the engine."""
        fault_point("worker_train", self.rank)
        objective = build_objective(stage, model=self.model, temperature=self.recipe.engine.sampling.temperature or 1.0,
                                    current_version=self.engine.policy_version, pool=self.pool, reference=self.reference)
        return self.trainer.train_step(batch, objective)

    # -- checkpoint (rl/checkpoint/format.py) ------------------------------------------------------------------
    def save(self, directory: str, background: bool = False) -> dict[str, float]:
        """Rank 0 writes weights and the trainer state (optimizer, LR schedule, RNG: safetensors + JSON,
        rl/checkpoint/format.py); every rank writes its parked states (with tools, each with its sandbox work directory as
        its pending call found it: rl/runtime/tool_turns.py). Call while interrupted. `background`: the state is
        copied into host memory here and the files are written by a thread while the worker goes on (`wait_saved`
        joins it and raises its error). Returns the bytes of in-flight state written by this rank (`inflight_bytes`)
        and the seconds of this call's parts: waiting for the previous background write (`wait_s`), copying the
        trainer's state (`trainer_copy_s`: with `background`), exporting the in-flight states (`inflight_s`: their KV
        out of the pool, their sandbox files), and writing (`write_s`: 0 with `background`)."""
        from rl.checkpoint.format import TRAINER_JSON, TRAINER_TENSORS, inflight_file, save_tree

        t0 = time.perf_counter()
        self.wait_saved()
        t1 = time.perf_counter()
        base = self._lora_base
        host = self._host_copies if background else None  # reused buffers: the pause is the copy alone
        weights = self.parallel.full_state_dict(adapters_only=base is not None, host=host) if background else None
        optimizer = self.parallel.full_optimizer_state(self.trainer.opt) if self.trainer else None
        trainer = None
        if self.rank == 0:
            trainer = {"optimizer": host.tree(optimizer, ("optimizer",)) if background else optimizer,
                       "scheduler": copy.deepcopy(self.trainer.sched.state_dict()) if self.trainer else None,
                       "torch_rng": torch.get_rng_state(),
                       "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        if host is not None:
            host.end()  # every queued device-to-host copy done
        t2 = time.perf_counter()
        held = self._held + (self.engine.snapshot() if self._in_place else [])  # `park_kv: pool`: copies of them
        if self.tools is not None:  # each sample's sandbox files as its pending call found them (rl/runtime/tool_turns.py)
            kept = self.tools.workdirs([s.request.sample_id for s in held])
            held = [replace(s, workdir=kept[s.request.sample_id]) for s in held]
        # the file's bytes as views of the states' host tensors (no KV byte copied here; the states are this save's:
        # a snapshot's, or parked ones that the engine only reads when they resume)
        parts = states_file_parts(states_on_host(held))
        t3 = time.perf_counter()
        timing = {"inflight_bytes": parts_nbytes(parts), "wait_s": t1 - t0,
                  "trainer_copy_s": t2 - t1, "inflight_s": t3 - t2, "write_s": 0.0}

        def write() -> dict[str, dict]:
            if background:
                fault_point("checkpoint_background", self.rank)
                if self.rank == 0:
                    write_weights(self.parallel.model, directory, state=weights, base=base)
            else:
                self.parallel.write_weights(directory, base=base)  # full tensors under FSDP2: every rank takes part
            if trainer is not None:
                save_tree(trainer, directory)
            mine = inflight_file(directory, self.rank)
            with mine.open("wb") as f:
                for part in parts:
                    f.write(part)
            if not background:
                return {}
            # the manifest's entries of this worker's files, made here (fsync, digest) instead of at the commit
            names = [mine.name] + (["model.safetensors", "config.json", TRAINER_JSON, TRAINER_TENSORS]
                                   + ([BASE_FILE] if base is not None else []) if self.rank == 0 else [])
            return {n: synced_entry(Path(directory) / n) for n in names}

        if not background:
            write()
            timing["write_s"] = time.perf_counter() - t3
            return timing
        self._writer = _Writer(write)
        return timing

    def wait_saved(self) -> dict[str, dict]:
        """Wait for a background checkpoint write (`save(..., background=True)`); raises what it raised, else returns
        the manifest entries of the files it wrote (model/checkpoint.py `synced_entry`)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return {}
        writer.join()
        return writer.result

    def save_done(self) -> bool:
        """No background checkpoint write is still running (a finished one is collected by `wait_saved`)."""
        return self._writer is None or not self._writer.is_alive()

    def load(self, directory: str) -> None:
        """Weights, optimizer, LR schedule and RNG from a checkpoint (after `begin_stage`)."""
        from rl.checkpoint.format import open_tree, read_tree

        self.parallel.load_weights(directory, base=self._lora_base)  # FSDP2: each rank reads only its rows
        if self.rollout_model is not self.model:
            refresh_rollout_copy(self.rollout_model, self.model)
        self.rollout_model.refresh_rollout_weights()
        with open_tree(directory) as state:  # tensors read as used: FSDP2 reads only its rows of the AdamW moments
            if self.trainer is not None and state["optimizer"] is not None:
                self.parallel.load_optimizer_state(self.trainer.opt, state["optimizer"])
                self.trainer.sched.load_state_dict(read_tree(state["scheduler"]))
            torch.set_rng_state(state["torch_rng"].read())
            if state["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(read_tree(state["cuda_rng"]))

    def load_inflight(self, files: Sequence[str]) -> list[str]:
        """Park the checkpoint's in-flight states, this rank's share (states are portable between
        engines, so the worker count may change); `resume` continues them. Returns their sample ids."""
        states = []
        for f in files:
            blobs = unpack_plain(Path(f).read_bytes())
            if not isinstance(blobs, list) or not all(isinstance(b, bytes) for b in blobs):
                raise ValueError(f"{f}: not a list of serialised rollout states")
            states += [RolloutState.from_bytes(b) for b in blobs]
        self._held = states[self.rank :: self.world_size]
        if self.tools is not None:  # each sample's next call restores its new sandbox from these first
            self.tools.restore_workdirs({s.request.sample_id: s.workdir for s in self._held})
        self._held = [replace(s, workdir=None) for s in self._held]
        return [s.request.sample_id for s in self._held]

    # -- misc ----------------------------------------------------------------------------------------
    def use_sandbox(self, socket_path: str) -> None:
        """Tool calls run on the sandbox server at `socket_path`, this node's that the job started (rl/runtime/groups.py)."""
        if self.tools is not None:
            self.tools.use_server(socket_path)

    def _full_weights(self) -> Decoder:
        return self.rollout_model if is_dtensor(next(self.model.parameters())) else self.model

    def ping(self) -> int:
        """Liveness (rl/runtime/groups.py calls it on its own thread while another call may be running)."""
        return os.getpid()

    def info(self) -> dict:
        """Size, engine counters and a checksum of the weights (data-parallel ranks must agree): the trainer's,
        or under FSDP2 (whose trainer holds shards) the engine's full copy."""
        return {"num_parameters": self.model.num_parameters(), "pid": os.getpid(), "rank": self.rank,
                "kv_blocks": self.engine.cache.num_blocks, "prefill_calls": self.engine.stats.prefill_calls,
                "prefill_tokens": self.engine.stats.prefill_tokens, "resumed_tokens": self.engine.stats.resumed_tokens,
                "reprefill_tokens": self.engine.stats.reprefill_tokens,
                "free_blocks": self.engine.cache.num_free_blocks,
                "weights_checksum": float(sum(p.detach().double().sum() for p in self._full_weights().parameters())),
                "node_ip": node_ip(),
                "trainer_state_bytes": trainer_state_bytes(self.model, self.trainer.opt if self.trainer else None),
                "peak_device_bytes": torch.cuda.max_memory_allocated() if self.recipe.run.device == "cuda" else 0}

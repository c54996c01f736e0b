"""TeacherPool: every teacher in host memory, a few on the device, switched at next to no cost (seed §5.2.4).

Seed §5.2.4 trains the final OPD stage with over 40 architecturally heterogeneous teachers and
"efficient switching among them at negligible cost". The pool does it with three pieces:

- Host store. Every teacher's weights are read once from its checkpoint into host memory, already in
  the device dtype, packed into one flat buffer per dtype (a load is one copy, not one per tensor),
  page-locked when CUDA exists so a host-to-device copy is asynchronous.
- Device LRU. Teachers are materialised on the device on demand; the resident set stays within
  `device_memory_mib` by evicting the least-recently-used teacher that this step no longer needs.
  A teacher is a `Decoder` built on the meta device (no allocation, no init) whose tensors are bound,
  at its first load and then for good, to views of one flat device buffer per dtype, so teachers may
  differ from each other and from the student in depth, width, heads, GQA, qk-norm, dense or MoE; only
  the vocabulary is shared (full-vocabulary OPD). As in PyTorch's FSDP, eviction frees a buffer's
  storage in place (`untyped_storage().resize_(0)`) and a load reallocates it and copies the host
  buffer in, so the bound views and Parameters see the new memory: a load is one allocation and one
  copy per dtype, with no per-tensor Python (which would hold the GIL against the compute thread).
- Prefetch. `run(groups, fn)` visits a step's teachers once each (resident ones first) and, while one
  computes, copies the next non-resident one in: on a side CUDA stream from a worker thread on the
  GPU (the compute stream waits on an event, so ordering is exact), on a worker thread on CPU. A
  driver that knows the next step's teachers passes them (`run(..., next_teachers=...)`), and the
  next step's first load then starts as soon as this step has nothing left to load.

Counters (`stats()`, reset per step): loads, prefetched loads, hits, evictions, seconds the compute
stream waited for weights (`load_wait_s`), seconds spent copying whether hidden or not (`load_s`),
teacher compute seconds, and `overhead = load_wait_s / compute_s`. On CUDA the intervals are timed
with events on the streams (resolved when `stats()` is read), so they measure device time, not
host time.

Live reconfiguration (seed §5.2.4: active teachers change during training) is `add` / `remove` of
teachers and `set_budget` / `set_prefetch`; none of them disturbs resident teachers still in use.

Weights handed out: `run`'s `fn` gets views of the resident teacher's device buffers, valid while
`fn` runs (the head weight is read in place, the hot path). Eviction frees that memory under any
view still in use, and PyTorch mostly does not check (a read through such a view dereferences a null
pointer: a segfault on CPU, an illegal-address error on CUDA; only some ops raise), so the pool checks
at eviction whether anything beyond its own bindings still refers to a buffer (a head weight kept
past `fn`, a tensor autograd saved for backward); if so it lets go of that teacher's buffers instead:
they stay valid for their holders and are freed once dropped (outside the budget meanwhile), the
skeleton goes back to meta, and its next load binds fresh buffers (correct, only slower).
`hidden_states` and `forward` return a clone of the head weight, safe to keep.

On CPU the "device" is the CPU itself and a load is still a real copy: the host buffer is copied into
freshly allocated storage (the resized buffer), so loads cost what they cost and the budget, LRU and
prefetch logic run and are tested exactly as on a GPU. (Where the allocator hands out fresh pages, the
copy also pays their first-touch faults: part of a CPU load's cost, hidden by prefetch like the rest.)

One file on purpose (~600 lines): the host store, residency, binding and prefetch share one lock and
the invariants above; split, each part would need the others' internals.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from model.config import ModelConfig, check_vocab, read_teacher_config
from model.decoder import Decoder
from teachers.config import TeacherPoolConfig, TeacherSpec

R = TypeVar("R")
_MIB = 1 << 20


class TeacherPoolError(ValueError):
    """A teacher the pool cannot take (unreadable, mismatched, too large for `device_memory_mib`): the job ends
    with this one line (rl/cli/commands.py), not a traceback."""
_KEEP_DTYPE_SUFFIXES = ("e_score_correction_bias",)
"""Buffers kept in their stored dtype (the MoE selection bias is added to float32 router scores)."""


@dataclass(frozen=True)
class TeacherOutput:
    """What OPD needs from a teacher for one batch: logits are `hidden @ head_weight.T`, computed
    chunk by chunk by the loss so [tokens, vocab] never materialises for both models at once."""

    hidden: torch.Tensor
    """Final normed hidden states [B, T, teacher hidden_size]."""
    head_weight: torch.Tensor
    """Output head [vocab, teacher hidden_size] (the embedding when the teacher ties them)."""
    routing: torch.Tensor | None
    """MoE teachers: expert ids [B, T, num_layers, top_k]; None for dense."""


@dataclass
class PoolStats:
    """Counters since the last `stats()` (one train step when the driver reads them once per step)."""

    loads: int = 0
    """Teachers copied host -> device (synchronous and prefetched)."""
    prefetched: int = 0
    """Of `loads`, those started ahead by prefetch."""
    hits: int = 0
    """Teacher uses served by an already resident copy (no load)."""
    evictions: int = 0
    """Resident teachers dropped to make room."""
    load_wait_s: float = 0.0
    """Seconds the compute stream waited for teacher weights (synchronous loads plus the unhidden
    tail of prefetches): the switching cost."""
    load_s: float = 0.0
    """Seconds spent copying weights, hidden by prefetch or not."""
    compute_s: float = 0.0
    """Seconds of teacher forward passes (including the caller's `fn`)."""
    teachers: int = 0
    """Teacher uses (forward calls)."""

    @property
    def overhead(self) -> float:
        """Switching cost as a fraction of teacher compute: load_wait_s / compute_s."""
        return self.load_wait_s / self.compute_s if self.compute_s > 0 else 0.0

    def as_metrics(self, prefix: str = "teachers/") -> dict[str, float]:
        keys = ("loads", "prefetched", "hits", "evictions", "load_wait_s", "load_s", "compute_s", "teachers")
        return {**{prefix + k: float(getattr(self, k)) for k in keys}, prefix + "overhead": self.overhead}


@dataclass
class _HostTeacher:
    name: str
    config: ModelConfig
    flat: dict[torch.dtype, torch.Tensor]
    """Host copy of all weights, one flat buffer per dtype (page-locked when CUDA exists): a load is
    one copy per dtype (usually one), not one per tensor."""
    layout: dict[str, tuple[torch.dtype, int, torch.Size]]
    """State key -> (buffer dtype, element offset, shape)."""
    nbytes: int
    module: Decoder
    """Skeleton built once on the meta device; at the first load bound to views of `device_flat`."""
    slots: list[tuple[torch.nn.Module, str, bool, str]]
    """(owning submodule, attribute, is a parameter, state key) of every tensor, for binding."""
    datasets: tuple[str, ...] = ()
    device_flat: dict[torch.dtype, torch.Tensor] | None = None
    """Device buffers (one per dtype, shaped like `flat`) whose views the skeleton's tensors are; None
    until the first load. Their storage holds `nbytes` while resident and 0 bytes once evicted."""
    own_refs: dict[torch.dtype, int] = field(default_factory=dict)
    """Each device buffer's storage use count with only the pool's references (buffer and bound views):
    more at eviction means someone else still holds a view."""


@dataclass
class _Resident:
    module: Decoder
    nbytes: int
    ready: torch.cuda.Event | None = None
    """CUDA prefetch: recorded on the side stream after the copies; the compute stream waits on it."""
    tensors: list[torch.Tensor] = field(default_factory=list)
    """CUDA prefetch: the device buffers, whose storage this load allocated on the side stream (marked as
    used by the compute stream once it waits, so that freeing them at eviction waits for its work)."""


class _Clock:
    """Interval marks: CUDA events on a stream (device time) or perf_counter (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class TeacherPool:
    """Host store of teachers, device-resident LRU set within a byte budget, prefetch of the next one."""

    def __init__(
        self,
        teachers: Iterable[TeacherSpec],
        device_memory_mib: float,
        *,
        prefetch: bool = True,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        pin_host_memory: bool = True,
        student_vocab: int | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.budget_bytes = int(device_memory_mib * _MIB)
        self.prefetch_enabled = prefetch
        self.dtype = dtype
        self.pin = pin_host_memory and torch.cuda.is_available()
        self.student_vocab = student_vocab
        self._host: dict[str, _HostTeacher] = {}
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._inflight: tuple[str, int, Future] | None = None  # (name, reserved bytes, future -> _Resident)
        self._clock = _Clock(self.device)
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-prefetch")
        self._lock = threading.Lock()  # guards the interval lists, appended to by the prefetch thread
        self._stats = PoolStats()
        self._pending: dict[str, list[tuple[Any, Any]]] = {"load_wait_s": [], "load_s": [], "compute_s": []}
        self.peak_resident_bytes = 0
        for spec in teachers:
            self.add(spec)

    @classmethod
    def from_config(cls, cfg: TeacherPoolConfig, device: str | torch.device = "cpu",
                    student_vocab: int | None = None) -> "TeacherPool":
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        return cls(cfg.teachers, cfg.device_memory_mib, prefetch=cfg.prefetch, device=device, dtype=dtype,
                   pin_host_memory=cfg.pin_host_memory, student_vocab=student_vocab)

    # ---- registry (live reconfiguration adds and removes teachers) --------------------------------
    def add(self, spec: TeacherSpec) -> None:
        """Read a teacher checkpoint into host memory. Errors (missing or damaged file, wrong keys or shapes,
        non-finite weights, vocabulary, too big for the budget) surface here as one-line ValueErrors, not in the
        middle of a train step; a teacher that fails leaves the pool as it was."""
        cfg = read_teacher_config(spec.checkpoint)
        if cfg.init is None:  # an asyncrl checkpoint directory: its state dict as saved
            from safetensors import SafetensorError
            from safetensors.torch import load_file  # only checkpoint reads need it

            from model.checkpoint import base_record
            from model.pretrained import read_state

            weights = Path(spec.checkpoint) / "model.safetensors"
            try:  # LoRA adapters alone (model/checkpoint.py BASE_FILE): on their base, checked; else the file as saved
                stored = read_state(spec.checkpoint)[1] if base_record(spec.checkpoint) else load_file(str(weights))
            except (SafetensorError, OSError, ValueError) as e:  # truncated, damaged, missing, another base: the teacher's
                raise TeacherPoolError(f"teacher {spec.name!r}: cannot read {str(weights)!r}: "
                                       f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}") from None
            from model.lora import as_plain  # a LoRA run's checkpoint: the teacher is its merged weights

            cfg, stored = as_plain(cfg, stored)
        else:  # a Hugging Face directory or GGUF file: converted tensor by tensor into a host Decoder
            from model.pretrained import build_decoder

            stored = build_decoder(cfg, "cpu", self.dtype).state_dict()
        self.add_weights(spec.name, cfg, stored, datasets=spec.datasets, source=f"checkpoint {str(spec.checkpoint)!r}")

    def add_weights(self, name: str, cfg: ModelConfig, stored: Mapping[str, torch.Tensor], *,
                    datasets: Iterable[str] = (), source: str = "in-memory weights") -> None:
        """Register a teacher from a state dict (Decoder layout; a tied head may be omitted)."""
        if name in self._host:
            raise TeacherPoolError(f"teacher {name!r} is already in the pool")
        if self.student_vocab is not None and (err := check_vocab(self.student_vocab, cfg, name)):
            raise TeacherPoolError(err)
        stored = dict(stored)
        expected = {k: tuple(v.shape) for k, v in _skeleton(cfg).state_dict().items()}
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight")
            stored.pop("lm_head.weight", None)
        got = {k: tuple(v.shape) for k, v in stored.items()}
        if got != expected:
            missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
            reshaped = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
            problems = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {unexpected[:3]}"] if unexpected else [])
            problems += [f"{k} is {got[k]} not {expected[k]}" for k in reshaped[:3]]
            raise TeacherPoolError(f"teacher {name!r} {source} does not match its config: {', '.join(problems)}")
        tensors = {}
        for k, v in stored.items():
            v = v.detach().to("cpu")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):  # a NaN teacher makes every KL NaN
                raise TeacherPoolError(f"teacher {name!r} {source} has non-finite weights in {k}")
            if self.dtype is not None and v.is_floating_point() and not k.endswith(_KEEP_DTYPE_SUFFIXES):
                v = v.to(self.dtype)
            tensors[k] = v
        sizes: dict[torch.dtype, int] = {}
        layout = {}
        for k, v in tensors.items():
            layout[k] = (v.dtype, sizes.get(v.dtype, 0), v.shape)
            sizes[v.dtype] = sizes.get(v.dtype, 0) + v.numel()
        flat = {dt: torch.empty(n, dtype=dt, pin_memory=self.pin) for dt, n in sizes.items()}
        for k, (dt, off, shape) in layout.items():
            flat[dt][off : off + shape.numel()].view(shape).copy_(tensors[k])
        nbytes = sum(t.numel() * t.element_size() for t in flat.values())
        if nbytes > self.budget_bytes:
            raise TeacherPoolError(f"teacher {name!r} needs {nbytes / _MIB:.3g} MiB on device but the pool's "
                                   f"device_memory_mib is {self.budget_bytes / _MIB:.3g}")
        module = _skeleton(cfg)
        slots = []
        for key in module.state_dict():
            path, _, attr = key.rpartition(".")
            owner = module.get_submodule(path)
            slots.append((owner, attr, attr in owner._parameters, key))
        self._host[name] = _HostTeacher(name, cfg, flat, layout, nbytes, module.requires_grad_(False).eval(), slots,
                                        tuple(datasets))

    def remove(self, name: str) -> None:
        self._settle_inflight()
        if self._resident.pop(name, None) is not None:
            _evict(self._host[name])
        del self._host[name]

    def set_budget(self, device_memory_mib: float) -> None:
        """Change the device budget live, evicting least-recently-used teachers until the rest fit."""
        budget = int(device_memory_mib * _MIB)
        too_big = [n for n, h in self._host.items() if h.nbytes > budget]
        if too_big:
            raise TeacherPoolError(f"device_memory_mib={device_memory_mib} cannot hold teachers {too_big[:3]}")
        self._settle_inflight()
        self.budget_bytes = budget
        while self.resident_bytes > budget:
            name, _ = self._resident.popitem(last=False)
            _evict(self._host[name])
            self._stats.evictions += 1

    def set_prefetch(self, enabled: bool) -> None:
        self.prefetch_enabled = enabled

    @property
    def names(self) -> list[str]:
        return list(self._host)

    def config(self, name: str) -> ModelConfig:
        return self._host[name].config

    def nbytes(self, name: str) -> int:
        """Device bytes of one teacher's weights."""
        return self._host[name].nbytes

    @property
    def resident(self) -> list[str]:
        """Device-resident teachers, least recently used first."""
        return list(self._resident)

    @property
    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self._resident.values())

    # ---- the API a train step uses ----------------------------------------------------------------
    def run(self, groups: Mapping[str, torch.Tensor], fn: Callable[[str, TeacherOutput], R],
            next_teachers: Iterable[str] = ()) -> dict[str, R]:
        """Score each teacher's batch: `groups` maps teacher name -> input_ids [B, T] (right-padded);
        `fn(name, output)` runs while that teacher is resident (e.g. the chunked OPD loss's teacher
        log-probs) and its result is returned per name. `output.head_weight` is the teacher's device
        weight itself, valid while `fn` runs: a result that keeps it (or a view of it) past `fn` should
        keep a clone instead (a kept view stays correct, but it makes the pool give up that teacher's
        in-place buffers at eviction: memory outside the budget until dropped, then a slower load).
        Each teacher is loaded at most once: resident
        teachers go first (then one already being prefetched), teachers still needed in this call are
        never evicted, and the next non-resident one is prefetched while the current one computes.

        `next_teachers`: the next call's teachers, when the driver already knows them (the next batch's
        groups). Once nothing of this call is left to load, the first of them that is not resident is
        prefetched, evicting neither a teacher this call still needs nor a resident one of the next
        call, so the next call's first load overlaps this call's last computes instead of stalling."""
        unknown = [n for n in groups if n not in self._host]
        if unknown:
            raise KeyError(f"unknown teachers {unknown}; the pool has {self.names}")
        landing = self._inflight[0] if self._inflight is not None else None
        cold = sorted((n for n in groups if n not in self._resident), key=lambda n: n != landing)  # stable
        order = [n for n in self._resident if n in groups] + cold
        needed = set(order)
        ahead = [n for n in next_teachers if n in self._host]
        results: dict[str, R] = {}
        for i, name in enumerate(order):
            entry = self._acquire(name, protect=needed)
            if self.prefetch_enabled:
                upcoming = next((n for n in order[i + 1:] if n not in self._resident), None)
                if upcoming is not None:
                    self._start_prefetch(upcoming, protect=needed)
                else:  # this call's loads are done: start on the next call's first one
                    first = next((n for n in ahead if n not in self._resident and n not in needed), None)
                    if first is not None:
                        self._start_prefetch(first, protect=needed | set(ahead))
            results[name] = self._compute(name, entry, groups[name], None, fn)
            needed.discard(name)
        return results

    def hidden_states(self, groups: Mapping[str, torch.Tensor]) -> dict[str, TeacherOutput]:
        """`run` returning the outputs themselves, each head weight a clone (the teacher's own is freed in
        place when it is evicted, possibly later in this very call): [vocab, hidden] more device memory per
        output, so prefer `run` with a consuming `fn` when device memory is tight."""
        return self.run(groups, _keep)

    def forward(self, name: str, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> TeacherOutput:
        """One teacher on one batch, loading it if needed (no prefetch of anything else). The head weight
        is a clone, as in `hidden_states`, valid after the teacher is evicted."""
        entry = self._acquire(name, protect={name})
        return self._compute(name, entry, input_ids, positions, _keep)

    def prefetch(self, name: str) -> bool:
        """Start copying `name` to the device ahead of use (e.g. the next step's first teacher).
        False when it is already resident, another prefetch is in flight, or there is no room."""
        if not self.prefetch_enabled:
            return False
        return self._start_prefetch(name, protect={name})

    def stats(self, reset: bool = True) -> PoolStats:
        """Counters since the last reset (CUDA: waits for the timed events)."""
        with self._lock:
            pending = {k: list(v) for k, v in self._pending.items()}
            if reset:
                for v in self._pending.values():
                    v.clear()
        out = replace(self._stats)
        for key, intervals in pending.items():
            setattr(out, key, getattr(out, key) + sum(self._clock.seconds(a, b) for a, b in intervals))
        if reset:
            self._stats = PoolStats()
        return out

    def close(self) -> None:
        self._settle_inflight()
        self._executor.shutdown(wait=True)

    # ---- internals --------------------------------------------------------------------------------
    def _acquire(self, name: str, protect: set[str]) -> _Resident:
        """The resident copy of `name`, loading it (or finishing its prefetch) if needed."""
        if name not in self._host:
            raise KeyError(f"unknown teacher {name!r}; the pool has {self.names}")
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if name in self._resident:
            self._resident.move_to_end(name)
            self._stats.hits += 1
            entry = self._resident[name]
            if entry.ready is not None:  # a prefetch that landed without being waited on yet
                self._await_copies(entry, stream)
            return entry
        start = self._clock.mark(stream)
        if self._inflight is not None and self._inflight[0] == name:
            entry = self._settle_inflight()
            self._await_copies(entry, stream)
        else:
            host = self._host[name]
            # A prefetch of another teacher may hold the room: let it land, then it is evictable
            # (last resort: even when this step still needs it, which costs it a second load).
            if not (self._make_room(host.nbytes, protect | {name})
                    or (self._settle_inflight() is not None and self._make_room(host.nbytes, protect | {name}))
                    or self._make_room(host.nbytes, {name})):
                raise RuntimeError(f"cannot fit teacher {name!r} ({host.nbytes / _MIB:.1f} MiB) in the pool's "
                                   f"{self.budget_bytes / _MIB:.1f} MiB")
            load_start = self._clock.mark(stream)
            _load(host, self.device, non_blocking=self.pin)  # on the compute stream: no event needed
            entry = _Resident(host.module, host.nbytes)
            with self._lock:
                self._pending["load_s"].append((load_start, self._clock.mark(stream)))
            self._resident[name] = entry
            self._stats.loads += 1
            self._track_peak()
        with self._lock:
            self._pending["load_wait_s"].append((start, self._clock.mark(stream)))
        return entry

    @staticmethod
    def _await_copies(entry: _Resident, stream: torch.cuda.Stream | None) -> None:
        """CUDA prefetch: the compute stream waits for the side stream's copies, and the allocator
        learns the buffers are used on the compute stream, so that freeing them at eviction (resize to 0)
        waits for the compute stream's work queued by then. Once per load: each load allocates anew."""
        if entry.ready is None:
            return
        stream.wait_event(entry.ready)
        for t in entry.tensors:
            t.record_stream(stream)
        entry.ready, entry.tensors = None, []

    def _compute(self, name: str, entry: _Resident, input_ids: torch.Tensor, positions: torch.Tensor | None,
                 fn: Callable[[str, TeacherOutput], R]) -> R:
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        start = self._clock.mark(stream)
        with torch.no_grad():
            ids = input_ids.to(self.device, non_blocking=True)
            pos = None if positions is None else positions.to(self.device, non_blocking=True)
            out = entry.module.forward_hidden(ids, pos)
        # outside no_grad: `fn` is typically the student's loss, which needs its graph (the teacher's
        # tensors were made under no_grad, so no gradient can reach the teacher)
        result = fn(name, TeacherOutput(out.hidden, entry.module.lm_head.weight.detach(), out.routing))
        with self._lock:
            self._pending["compute_s"].append((start, self._clock.mark(stream)))
        self._stats.teachers += 1
        return result

    def _make_room(self, nbytes: int, protect: set[str]) -> bool:
        """Evict least-recently-used unprotected teachers until `nbytes` more fit (with any in-flight
        reservation counted). False, evicting nothing, when that is impossible."""
        reserved = self._inflight[1] if self._inflight is not None else 0
        free = self.budget_bytes - self.resident_bytes - reserved
        if free >= nbytes:
            return True
        victims = []
        for n, r in self._resident.items():
            if n in protect:
                continue
            victims.append(n)
            free += r.nbytes
            if free >= nbytes:
                break
        if free < nbytes:
            return False
        for n in victims:
            del self._resident[n]
            _evict(self._host[n])
            self._stats.evictions += 1
        return True

    def _start_prefetch(self, name: str, protect: set[str]) -> bool:
        if name in self._resident or self._inflight is not None:
            return False
        host = self._host[name]
        if not self._make_room(host.nbytes, protect):
            return False
        future = self._executor.submit(self._load_async, host)
        self._inflight = (name, host.nbytes, future)
        self._track_peak()
        return True

    def _load_async(self, host: _HostTeacher) -> _Resident:
        """Prefetch worker: copy on the side stream (CUDA) or in this thread (CPU)."""
        if self._side_stream is None:
            start = self._clock.mark()
            _load(host, self.device, non_blocking=False)
            with self._lock:
                self._pending["load_s"].append((start, self._clock.mark()))
            return _Resident(host.module, host.nbytes)
        # The side stream is current: the storage is allocated for it and the copies are queued on it.
        with torch.cuda.device(self.device), torch.cuda.stream(self._side_stream):
            start = self._clock.mark(self._side_stream)
            tensors = _load(host, self.device, non_blocking=self.pin)
            ready = self._clock.mark(self._side_stream)
        with self._lock:
            self._pending["load_s"].append((start, ready))
        return _Resident(host.module, host.nbytes, ready=ready, tensors=tensors)

    def _settle_inflight(self) -> _Resident | None:
        """Wait for the in-flight prefetch (if any) and make it resident; returns it."""
        if self._inflight is None:
            return None
        name, _, future = self._inflight
        self._inflight = None
        entry = future.result()  # a failed copy raises here, in the caller's thread
        self._resident[name] = entry
        self._stats.loads += 1
        self._stats.prefetched += 1
        return entry

    def _track_peak(self) -> None:
        reserved = self._inflight[1] if self._inflight is not None else 0
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes + reserved)


def _skeleton(cfg: ModelConfig) -> Decoder:
    """A Decoder without storage: building it allocates and initialises nothing."""
    with torch.device("meta"):
        return Decoder(cfg)


def _keep(_name: str, out: TeacherOutput) -> TeacherOutput:
    """`fn` for outputs that outlive the teacher's residency: the head weight cloned off its buffer."""
    return replace(out, head_weight=out.head_weight.clone())


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors (and storage objects) share `t`'s storage (the reference count of its StorageImpl,
    through the private binding PyTorch's own tests use; tests/unit/test_teacher_pool.py checks it).
    None where this torch lacks the binding: eviction then always lets go (correct, slower loads)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else use_count(t.untyped_storage()._cdata)


def _load(host: _HostTeacher, device: torch.device, non_blocking: bool) -> list[torch.Tensor]:
    """Copy the host store into freshly allocated device storage (for the current stream on CUDA),
    one copy per flat buffer; returns the device buffers. The first load allocates the buffers and
    binds views of them into the skeleton (not `add`: a view needs its storage allocated, and adding a
    teacher takes no device memory); later ones reallocate each buffer's storage in place, which the
    bound views see, so they run no per-tensor Python."""
    if host.device_flat is None:
        _bind(host, {dt: torch.empty(buf.shape, dtype=dt, device=device) for dt, buf in host.flat.items()})
    else:
        for buf in host.device_flat.values():
            storage = buf.untyped_storage()
            assert storage.nbytes() == 0, "loading a teacher that is already resident"
            storage.resize_(buf.numel() * buf.element_size())
    for dt, buf in host.device_flat.items():
        buf.copy_(host.flat[dt], non_blocking=non_blocking)
    return list(host.device_flat.values())


def _bind(host: _HostTeacher, device_flat: dict[torch.dtype, torch.Tensor]) -> None:
    """Bind views of the device buffers into the teacher's skeleton (once per buffer set: loads after
    the first reuse the binding) and note the buffers' own use counts."""
    state = {k: device_flat[dt][off : off + shape.numel()].view(shape) for k, (dt, off, shape) in host.layout.items()}
    for owner, attr, is_param, key in host.slots:
        if key not in state:  # the tied head: bound below to the embedding
            continue
        if is_param:
            owner._parameters[attr] = torch.nn.Parameter(state[key], requires_grad=False)
        else:
            owner._buffers[attr] = state[key]
    if host.config.tie_word_embeddings:
        host.module.lm_head._parameters["weight"] = host.module.model.embed_tokens.weight
    del state  # the parameters' own views remain
    host.device_flat = device_flat
    host.own_refs = {dt: _storage_refs(buf) for dt, buf in device_flat.items()}


def _evict(host: _HostTeacher) -> None:
    """Free a teacher's device memory: each buffer's storage is resized to 0 (the memory goes back to
    the allocator at once; on CUDA after the streams recorded on it) and the binding stays for the next
    load. Most ops do not check a view's storage on use (a read after the resize goes through a null
    pointer: a segfault on CPU, an illegal-address error on CUDA), so when anything beyond the pool's own
    bindings still refers to a buffer, the pool lets go of the buffers instead: their holders keep them,
    freed once dropped, and the skeleton goes back to meta until a load binds fresh buffers."""
    if host.device_flat is None:
        return
    refs = {dt: _storage_refs(buf) for dt, buf in host.device_flat.items()}
    if any(n is None or n > host.own_refs[dt] for dt, n in refs.items()):
        _unbind(host)
        return
    for buf in host.device_flat.values():
        buf.untyped_storage().resize_(0)


def _unbind(host: _HostTeacher) -> None:
    """Let go of the device buffers (the skeleton goes back to meta tensors); their memory frees once
    other holders (e.g. a kept head weight) let go too."""
    for owner, attr, is_param, _key in host.slots:
        table = owner._parameters if is_param else owner._buffers
        t = table[attr]
        if t is not None and t.device.type != "meta":
            meta = torch.empty_like(t, device="meta")
            table[attr] = torch.nn.Parameter(meta, requires_grad=False) if is_param else meta
    if host.config.tie_word_embeddings:
        host.module.lm_head._parameters["weight"] = host.module.model.embed_tokens.weight
    host.device_flat, host.own_refs = None, {}

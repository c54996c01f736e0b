"""Where the components run: Ray actors (default) or in-process objects (tests, debugging).

`Runtime` starts Ray locally (`ray.init`) or joins the cluster at `runtime.ray_address`, creates one
`PolicyWorker` actor per device (each in its bundle of a placement group: rl/runtime/placement.py) and a pool of CPU
`RewardWorker` actors, and exposes them as `PolicyGroup` and `RewardGroup`: typed methods that call every
worker (or one) and gather the results.
The controller code is the same for both modes; only `Group` knows whether a call crosses a process
boundary.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rewards.task import Trajectory, Verdict
from rl.runtime import placement
from rl.config import GRPOStage, OPDStage, Recipe, SFTStage
from rl.runtime.reward_worker import RewardWorker
from rl.train.trainer import StepMetrics, TrainBatch
from rl.runtime.sandbox_nodes import NodeSandboxes, run_key
from rl.runtime.worker import PolicyWorker, StepResult
from rollout.types import Generation, GenerationRequest
from teachers.config import TeacherSpec

R = TypeVar("R")


class _Done:
    """An already-computed result, standing in for a Ray ObjectRef in in-process mode."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class WorkerFailure(RuntimeError):
    """A worker died or stopped answering (one line naming the worker and the phase). `at_start`: it died
    raising in its constructor (a configuration the worker's machine cannot take): no run state was lost."""

    def __init__(self, message: str, at_start: bool = False):
        super().__init__(message)
        self.at_start = at_start


def _died(label: tuple, error: Exception, name: str) -> tuple[str, bool]:
    """(what to say of a dead worker, whether it died in its constructor: then with the error's own last line)."""
    (i, method), text = label, str(error)
    if "error raised in its creation task" in text:
        return f"{name} {i} failed to start: {text.strip().splitlines()[-1]}", True
    return f"{name} {i} died during {method} ({type(error).__name__})", False


HEALTH = {"health": 1}
"""A Ray concurrency group of one thread for `ping`, so that a worker busy in a long call still answers it."""
GRACE_S = 5.0
"""After one worker's call fails, how long the others get to answer before those still silent count as hung."""


class Group:
    """A list of workers, local objects or Ray actor handles, called uniformly. Remote calls are bounded by
    `timeout_s`: a worker that died or did not answer in time raises WorkerFailure naming it and the call."""

    def __init__(self, members: list, remote: bool, name: str = "worker", timeout_s: float | None = None):
        self.members, self.remote, self.name, self.timeout_s = members, remote, name, timeout_s
        self.timeout_field = "runtime.worker_timeout_s"
        """The recipe field a slow call's message tells the user to raise."""
        self._calls: dict = {}  # pending remote futures -> (worker index, method)

    def __len__(self) -> int:
        return len(self.members)

    def submit(self, i: int, method: str, *args, **kwargs):
        m = self.members[i]
        if self.remote:
            future = getattr(m, method).remote(*args, **kwargs)
            self._calls[future] = (i, method)
            return future
        return _Done(getattr(m, method)(*args, **kwargs))

    def submit_all(self, method: str, *args, **kwargs) -> list:
        return [self.submit(i, method, *args, **kwargs) for i in range(len(self.members))]

    def _get_remote(self, futures: list) -> list:
        """Every result. A task's own exception is re-raised as is (Ray's error is also of its class), unless a
        worker died or hung: then WorkerFailure names them. A worker that has not answered by the deadline (or
        within GRACE_S of another's failure) is asked `ping` on its own thread: silent means hung or stopped;
        one that answers is alive in a call that is merely slow (or waits on a hung peer's collective)."""
        import ray
        from ray.exceptions import RayActorError

        labels = {f: self._calls.pop(f, (None, "?")) for f in futures}
        deadline = time.monotonic() + (self.timeout_s if self.timeout_s is not None else float("inf"))
        results, errors, pending = {}, {}, list(futures)
        while pending:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            done, pending = ray.wait(pending, num_returns=1, timeout=None if wait == float("inf") else wait)
            for f in done:
                try:
                    results[f] = ray.get(f)
                except Exception as e:  # the worker's own exception, or its death
                    errors[f] = e
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        died = [(labels[f], e) for f, e in errors.items() if isinstance(e, RayActorError)]
        silent = [labels[f] for f in pending if not self._answers_ping(labels[f][0])]
        if died or silent:
            said = [_died(label, e, self.name) for label, e in died]
            parts = [text for text, _ in said]
            parts += [f"{self.name} {i} did not answer {method} within {self.timeout_s:g} s and does not answer a ping "
                      "(hung or stopped)" for i, method in silent]
            raise WorkerFailure("; ".join(parts), at_start=bool(said) and all(start for _, start in said) and not silent)
        if errors:
            raise next(iter(errors.values()))
        if pending:
            i, method = labels[pending[0]]
            raise WorkerFailure(f"{self.name} {i} did not finish {method} within {self.timeout_s:g} s "
                                f"(alive: raise {self.timeout_field} if a call may take that long)")
        return [results[f] for f in futures]

    def _answers_ping(self, i: int | None) -> bool:
        import ray

        if i is None:
            return True
        try:
            ray.get(self.members[i].ping.options(concurrency_group="health").remote(), timeout=GRACE_S)
            return True
        except Exception:  # timed out, or the actor is gone
            return False

    def get(self, futures):
        """Block for one future or a list of them."""
        if isinstance(futures, list):
            if self.remote:
                return self._get_remote(futures)
            return [f.value for f in futures]
        return self.get([futures])[0]

    def ready(self, futures: list) -> bool:
        """True when every future has completed (never blocks)."""
        if not self.remote or not futures:
            return True
        import ray

        done, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
        return len(done) == len(futures)

    def call_all(self, method: str, *args, **kwargs) -> list:
        return self.get(self.submit_all(method, *args, **kwargs))


class PolicyGroup:
    """The PolicyWorkers (one per device) behind `PolicyWorker`'s public API: each method runs on every
    worker (or the one named) and returns when all are done."""

    def __init__(self, group: Group):
        self.group = group

    def __len__(self) -> int:
        return len(self.group)

    def _all(self, method: Callable[..., R], *args) -> list[R]:
        return self.group.call_all(method.__name__, *args)

    def _each(self, method: Callable[..., R], args_per_worker: dict[int, tuple]) -> list[R]:
        futures = [self.group.submit(w, method.__name__, *args) for w, args in args_per_worker.items()]
        return self.group.get(futures)

    def begin_stage(self, stage: SFTStage | GRPOStage | OPDStage) -> None:
        self._all(PolicyWorker.begin_stage, stage)

    def add_requests(self, per_worker: dict[int, list[GenerationRequest]]) -> None:
        self.results(self.submit_requests(per_worker))

    def rollout(self, num_steps: int) -> list[StepResult]:
        return self.results(self.submit_rollout(num_steps))

    @property
    def remote(self) -> bool:
        """Whether the workers are Ray actors (their calls can be queued ahead of their results)."""
        return self.group.remote

    def submit_requests(self, per_worker: dict[int, list[GenerationRequest]]) -> list:
        """`add_requests` without waiting: futures for `results` (a worker runs its calls in submission order)."""
        return [self.group.submit(w, PolicyWorker.add_requests.__name__, reqs) for w, reqs in per_worker.items()]

    def submit_rollout(self, num_steps: int, per_worker: dict[int, list[GenerationRequest]] | None = None) -> list:
        """`rollout` on every worker without waiting: futures for `results`; `per_worker` requests are queued at the
        start of that call (in the same actor call)."""
        adds = per_worker or {}
        return [self.group.submit(w, PolicyWorker.rollout.__name__, num_steps, adds.get(w, ())) for w in range(len(self))]

    def results(self, futures: list) -> list:
        return self.group.get(futures) if futures else []

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Run requests to completion, spread over the workers (rows i, i + n, ...), in request order."""
        n = len(self)
        parts = self._each(PolicyWorker.generate, {w: (requests[w::n],) for w in range(n)})
        by_id = {g.sample_id: g for part in parts for g in part}
        return [by_id[r.sample_id] for r in requests]

    def interrupt(self) -> list[dict[str, float]]:
        return self._all(PolicyWorker.interrupt)

    def resume(self) -> list[dict[str, float]]:
        return self._all(PolicyWorker.resume)

    def drop_inflight(self) -> None:
        self._all(PolicyWorker.drop_inflight)

    def train_step(self, batches: list[TrainBatch] | list[list[TrainBatch]], stage: SFTStage | GRPOStage | OPDStage
                   ) -> list[StepMetrics]:
        """Worker w trains on batches[w] (data parallel: every batch carries the step's global token count), or
        on each of its mini-batches batches[w][j] in turn, one optimizer step each (every worker as many)."""
        return self._each(PolicyWorker.train_step, {w: (b, stage) for w, b in enumerate(batches)})

    def update_weights(self, version: int) -> None:
        self._all(PolicyWorker.update_weights, version)

    def add_teachers(self, specs: list[TeacherSpec]) -> None:
        self._all(PolicyWorker.add_teachers, specs)

    def remove_teachers(self, names: list[str]) -> None:
        self._all(PolicyWorker.remove_teachers, names)

    def save(self, directory: str, background: bool = False) -> list[dict[str, float]]:
        """Every worker's `PolicyWorker.save`; their reports (bytes, seconds of each part), one a worker."""
        return self._all(PolicyWorker.save, directory, background)

    def wait_saved(self) -> dict[str, dict]:
        """Every worker's background checkpoint write is done (its error raised); their files' manifest entries."""
        return {name: entry for entries in self._all(PolicyWorker.wait_saved) for name, entry in entries.items()}

    def saves_done(self) -> bool:
        return all(self._all(PolicyWorker.save_done))

    def load(self, directory: str) -> None:
        self._all(PolicyWorker.load, directory)

    def load_inflight(self, files: list[str]) -> list[list[str]]:
        return self._all(PolicyWorker.load_inflight, files)

    def info(self) -> list[dict]:
        return self._all(PolicyWorker.info)


class RewardGroup:
    """CPU reward workers: verification runs beside generation, collected when ready."""

    def __init__(self, group: Group):
        self.group = group
        self._next = 0

    def submit(self, trajectories: list[Trajectory]):
        """Start verifying; returns a handle for `ready` / `get` (workers take turns)."""
        w, self._next = self._next, (self._next + 1) % len(self.group)
        return self.group.submit(w, RewardWorker.verify.__name__, trajectories)

    def ready(self, handle) -> bool:
        return self.group.ready([handle])

    def get(self, handle) -> list[Verdict]:
        return self.group.get(handle)

    def cut_short(self) -> None:
        """Preemption: every worker's verdicts stop waiting on user code a second from now (RewardWorker.cut_short).
        Returns at once (it runs in a signal handler): remote calls go out on a thread, on the actors' health thread."""
        if not self.group.remote:
            for m in self.group.members:
                m.cut_short()
            return
        threading.Thread(target=lambda: [m.cut_short.options(concurrency_group="health").remote()
                                         for m in self.group.members], name="cut-short", daemon=True).start()


class Runtime:
    def __init__(self, recipe: Recipe, run_dir: str | os.PathLike | None = None, say: Callable[[str], None] = print):
        """`run_dir` names the servers of `sandbox.socket: auto` (rl/runtime/sandbox_nodes.py: their state directories, so
        that a resumed run reaps what a killed one left). Whatever this starts is stopped again if it fails."""
        self.remote = recipe.runtime.ray
        self.policy: PolicyGroup | None = None
        self.rewards: RewardGroup | None = None
        self.sandboxes: NodeSandboxes | None = None
        self.placement_group = None  # the policy workers' (rl/runtime/placement.py)
        try:
            self._start_workers(recipe)
            if recipe.sandbox_server == "auto":
                self._start_sandboxes(recipe, run_dir, say)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, recipe: Recipe) -> None:
        cfg = recipe.runtime
        n = cfg.num_workers
        if not self.remote:
            if n != 1:
                raise ValueError("runtime.num_workers > 1 needs runtime.ray: true")
            self.policy = PolicyGroup(Group([PolicyWorker(recipe)], remote=False))
            self.rewards = RewardGroup(Group([RewardWorker(recipe)], remote=False))
            return
        import ray

        self._owns_ray = not ray.is_initialized()  # a Ray the caller started (a bench running several jobs) stays up
        if self._owns_ray:
            if cfg.ray_address:
                ray.init(address=cfg.ray_address, log_to_driver=True)
            else:
                # address="local": a Ray of the job's own, never a cluster someone `ray start`ed on this machine (a bare
                # ray.init() joins the newest one, and refuses num_cpus there: CI's two-node test beside a job, 2026-12-04)
                ray.init(address="local", num_cpus=cfg.num_cpus or os.cpu_count(), include_dashboard=False,
                         log_to_driver=True)
        threads = max(1, recipe.run.num_threads // n)
        fault = {"ASYNCRL_FAULT": os.environ["ASYNCRL_FAULT"]} if os.environ.get("ASYNCRL_FAULT") else {}
        bundle = placement.worker_bundle(recipe.run.device, cfg.cpus_per_worker)  # every worker's device reserved first
        self.placement_group = None if bundle is None else placement.reserve(n, bundle, cfg.placement_strategy,
                                                                             cfg.worker_start_timeout_s)
        actor = ray.remote(num_cpus=cfg.cpus_per_worker, num_gpus=1 if recipe.run.device == "cuda" else 0,
                           concurrency_groups=HEALTH, runtime_env={"env_vars": fault} if fault else None)(PolicyWorker)
        group = Group([actor.options(**placement.actor_options(self.placement_group, r))
                       .remote(recipe, rank=r, world_size=n, num_threads=threads) for r in range(n)], remote=True,
                      name="policy worker", timeout_s=cfg.worker_timeout_s)
        self.policy = PolicyGroup(group)
        reward_actor = ray.remote(num_cpus=0, concurrency_groups=HEALTH)(RewardWorker)
        self.rewards = RewardGroup(Group([reward_actor.remote(recipe) for _ in range(cfg.reward_workers())], remote=True,
                                         name="reward worker", timeout_s=cfg.worker_timeout_s))
        group.timeout_s, group.timeout_field = cfg.worker_start_timeout_s, "runtime.worker_start_timeout_s"
        if n > 1:  # the group meets at rank 0's node address (a cluster spans nodes), not at a loopback address
            address = group.get(group.submit(0, "rendezvous_address"))
            group.call_all("join_process_group", address)
        self.policy.info()  # surface construction errors now
        group.timeout_s, group.timeout_field = cfg.worker_timeout_s, "runtime.worker_timeout_s"

    def _start_sandboxes(self, recipe: Recipe, run_dir, say: Callable[[str], None]) -> None:
        """`sandbox.socket: auto`: a sandbox server on each node a worker runs on (rl/runtime/sandbox_nodes.py); each worker
        gets its node's socket."""
        self.sandboxes = NodeSandboxes(run_key(run_dir), recipe.sandbox.backend, recipe.sandbox_slots(),
                                       remote=self.remote, say=say, warm_interpreter=recipe.sandbox.warm_interpreter)
        policy, rewards = self.policy.group, self.rewards.group
        if not self.remote:
            socket = self.sandboxes.start([""], driver_node="")[""]
            policy.call_all("use_sandbox", socket)
            rewards.call_all("use_sandbox", socket)
            return
        policy_nodes = [i["node_ip"] for i in self.policy.info()]
        reward_nodes = rewards.call_all("node_ip")
        sockets = self.sandboxes.start(policy_nodes + reward_nodes, driver_node=placement.node_ip())
        policy.get([policy.submit(i, "use_sandbox", sockets[ip]) for i, ip in enumerate(policy_nodes)])
        rewards.get([rewards.submit(i, "use_sandbox", sockets[ip]) for i, ip in enumerate(reward_nodes)])

    def shutdown(self) -> None:
        """End the workers, then the sandbox servers the job started, then a Ray this job started; each step
        runs even when one before it fails."""
        try:
            if self.remote:
                import ray

                for g in (self.policy, self.rewards):
                    for m in g.group.members if g is not None else []:
                        ray.kill(m)
                placement.release(self.placement_group)  # a Ray the caller started (a bench) gets its resources back
        finally:
            try:
                if self.sandboxes is not None:
                    self.sandboxes.stop()
            finally:
                if self.remote and getattr(self, "_owns_ray", False):
                    import ray

                    if ray.is_initialized():
                        ray.shutdown()

"""The reward workers' side (rl/runtime/groups.py starts them): verify finished samples on CPU, one task object per
dataset. A module of its own, light on purpose: a Ray reward actor imports this module and the tasks', not torch, the
trainer or the engine (rl/runtime/groups.py imports all of them; ~2 s of every reward actor's start on a 2-core machine)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rewards import supervised
from rewards.supervised import verdict_problem
from rewards.task import Trajectory, Verdict, VerifyContext
from rewards.verifiers import RewardFunctionFailed
from rl.config import Recipe
from rl.runtime.placement import node_ip


class RewardWorker:
    """Verifies finished samples on CPU (one task object per dataset)."""

    def __init__(self, recipe: Recipe):
        supervised.reset_cut_short()  # a job before this one in the process (in-process runtime) may have been preempted
        self.tasks = {d.name: d.build() for d in recipe.datasets}
        self.limits = recipe.sandbox.limits
        self.ctx = VerifyContext()
        if recipe.sandbox_server == "apart":  # verifiers that run code get the node's sandbox server
            self.use_sandbox(recipe.sandbox.socket)

    def use_sandbox(self, socket_path: str) -> None:
        """Verifiers that run code get a runner on the sandbox server at `socket_path` (this node's)."""
        from rl.runtime.code_runner import SandboxCodeRunner

        self.ctx = VerifyContext(code=SandboxCodeRunner(socket_path, self.limits))

    def verify(self, trajectories: Sequence[Trajectory]) -> list[Verdict]:
        """Verdicts in order; each dataset's samples in one batch where its task verifies batches (`verify_many`)."""
        out: list[Verdict | None] = [None] * len(trajectories)
        by_dataset: dict[str, list[int]] = {}
        for i, t in enumerate(trajectories):
            by_dataset.setdefault(t.problem.dataset, []).append(i)
        for name, idx in by_dataset.items():
            for i, v in zip(idx, verify_batch(self.tasks[name], [trajectories[i] for i in idx], self.ctx)):
                out[i] = v
        return out

    def cut_short(self) -> None:
        """The job is stopping (SIGTERM): verdicts stop waiting on user code a second from now (those cut short score
        0 with that reason), so the preemption checkpoint is written promptly. Called on the actor's health thread
        (rl/runtime/groups.py), beside a `verify` in progress."""
        supervised.cut_short()

    def node_ip(self) -> str | None:
        """This worker's node address as Ray knows it (None outside Ray)."""
        return node_ip()

    def ping(self) -> int:
        return os.getpid()


def verify_batch(task, trajectories: list[Trajectory], ctx: VerifyContext) -> list[Verdict]:
    """`verify_one` of each; through the task's `verify_many` when it has one and there is more than one (a
    batch that raises is verified again one by one, so the failure stays the sample's)."""
    many = getattr(task, "verify_many", None)
    if many is not None and len(trajectories) > 1:
        try:
            verdicts = many(trajectories, ctx)
            if len(verdicts) == len(trajectories):
                return [checked(v, "verifier") for v in verdicts]
        except RewardFunctionFailed:
            raise
        except Exception:  # noqa: BLE001 - a user's verifier: retried per sample, where verify_one names the error
            pass
    return [verify_one(task, t, ctx) for t in trajectories]


def verify_one(task, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
    """The task's verdict; a verifier that raises or returns no valid Verdict scores 0 with the reason instead of
    ending the job (the sample is kept, so the failure is visible in the store). RewardFunctionFailed (a `python:`
    verifier that keeps failing) is the job's: it passes."""
    try:
        return checked(task.verify(trajectory, ctx), "verifier")
    except RewardFunctionFailed:
        raise
    except Exception as e:  # a user's verifier: any failure is the sample's, not the run's
        return Verdict(0.0, False, f"verifier error: {type(e).__name__}: {str(e)[:200]}")


def checked(verdict, who: str) -> Verdict:
    """`verdict` when it is a valid Verdict (rewards.supervised.verdict_problem), else a 0 Verdict saying why: the
    trainer computes with every field."""
    problem = verdict_problem(verdict)
    return verdict if problem is None else Verdict(0.0, False, f"{who} returned {problem}")

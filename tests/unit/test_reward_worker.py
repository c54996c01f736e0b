"""RewardWorker.verify (rl/runtime/reward_worker.py): each dataset's samples in one batch where the task verifies batches, the
verdicts back in the order given; a batch that raises is verified one by one (pure logic: stand-in tasks). And the
module a Ray reward actor imports stays light: no torch."""

import subprocess
import sys

import pytest

from rewards.task import Problem, Trajectory, Verdict, VerifyContext
from rl.runtime.reward_worker import RewardWorker


class Batched:
    def __init__(self, fail_batch=False):
        self.batches, self.fail_batch = [], fail_batch

    def verify(self, t, ctx):
        if t.response == "boom":
            raise ValueError("bad row")
        return Verdict(float(t.response == t.problem.answer), t.response == t.problem.answer, f"one {t.response}")

    def verify_many(self, ts, ctx):
        self.batches.append([t.problem.problem_id for t in ts])
        if self.fail_batch:
            raise RuntimeError("batch failed")
        return [Verdict(float(t.response == t.problem.answer), t.response == t.problem.answer, f"many {t.response}")
                for t in ts]


class OneByOne:
    def verify(self, t, ctx):
        return Verdict(0.5, False, f"plain {t.response}")


def _worker(tasks):
    w = RewardWorker.__new__(RewardWorker)
    w.tasks, w.ctx = tasks, VerifyContext()
    return w


def _traj(ds, i, response, answer="1"):
    return Trajectory.single(Problem(f"{ds}:{i}", ds, "q", answer), response)


def test_each_dataset_is_one_batch_and_the_verdicts_keep_their_order():
    a, b = Batched(), OneByOne()
    ts = [_traj("a", 0, "1"), _traj("b", 1, "x"), _traj("a", 2, "2"), _traj("a", 3, "1"), _traj("b", 4, "y")]
    got = _worker({"a": a, "b": b}).verify(ts)
    assert [v.reason for v in got] == ["many 1", "plain x", "many 2", "many 1", "plain y"]
    assert [v.correct for v in got] == [True, False, False, True, False]
    assert a.batches == [["a:0", "a:2", "a:3"]]


def test_a_batch_that_raises_is_verified_one_by_one_and_the_failure_stays_the_samples():
    a = Batched(fail_batch=True)
    got = _worker({"a": a}).verify([_traj("a", 0, "1"), _traj("a", 1, "boom"), _traj("a", 2, "3")])
    assert [v.reason for v in got[::2]] == ["one 1", "one 3"] and got[0].correct
    assert got[1].reason == "verifier error: ValueError: bad row" and not got[1].correct


@pytest.mark.parametrize("recipe", ["configs/tiny_grpo.yaml", "configs/smollm2_grpo.yaml"])
def test_a_reward_worker_is_built_without_torch(recipe):
    """A Ray reward actor imports its class's module (rl/runtime/reward_worker.py) and builds the recipe's tasks: neither
    imports torch, Triton or SQLAlchemy (rl/runtime/groups.py, the old home, imports all three: seconds of every reward
    actor's start on a 2-core machine)."""
    code = ("import sys; from rl.runtime.reward_worker import RewardWorker; from rl.recipe_io import load_recipe; "
            f"w = RewardWorker(load_recipe({recipe!r}, [])); assert w.tasks; "
            "print(sorted(m for m in ('torch', 'triton', 'sqlalchemy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]"

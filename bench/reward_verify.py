"""Verdicts per second of the reward workers (issue #14): the SmolLM2 recipe's math verifier (math-verify) on the
word-problem test split's worked solutions (and as many wrong answers), on Ray reward actors created as
rl/runtime/groups.py creates them (num_cpus 0, a health concurrency group: methods run off the actor's main thread, where
math-verify's SIGALRM limits cannot run, so verdicts go through a child process). Side by side in one run: one
child call per sample (`verify_one` each, the path before batching), the batch in one child call
(`RewardWorker.verify`), and the batch split over several actors (`runtime.num_reward_workers`); on the driver's
main thread (in-process runtime) for reference.

Last line: RESULT per_sample_ms=.. batched_ms=.. batched_4_workers_ms=.. main_thread_ms=.. (ms of wall time per verdict)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from rewards.task import Problem, Trajectory  # noqa: E402
from rl.config import Recipe  # noqa: E402
from rl.runtime.reward_worker import RewardWorker, verify_one  # noqa: E402
from rl.runtime.groups import HEALTH  # noqa: E402


class BenchRewardWorker(RewardWorker):
    def verify_each(self, trajectories):
        """The path before batching: one verdict, one child call."""
        return [verify_one(self.tasks[t.problem.dataset], t, self.ctx) for t in trajectories]


def trajectories(n: int) -> list[Trajectory]:
    rows = [json.loads(line) for line in open(ROOT / "configs/data/word_problems_test.jsonl")]
    out = []
    for i in range(n):
        r = rows[i % len(rows)]
        wrong = i % 2 == 1  # half the answers wrong, as a policy's are
        response = r["solution"].replace(f"answer is {r['answer']}", f"answer is {int(r['answer']) + 1}") if wrong \
            else r["solution"]
        out.append(Trajectory.single(Problem(f"wp:{i}", "wp", r["question"], str(r["answer"])), response))
    return out


def recipe() -> Recipe:
    return Recipe.model_validate({
        "datasets": [{"type": "jsonl", "name": "wp", "path": str(ROOT / "configs/data/word_problems_train.jsonl"),
                      "prompt": "question", "answer": "answer", "verifier": "math"}],
        "stages": [{"type": "sft", "max_steps": 1}]})


def timed(fn, items, reps: int) -> tuple[float, list]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(items)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best / len(items), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 verdicts, 2 reps (under a minute here)")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=4, help="actors of the split run")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, reps = (256, 2) if args.quick else (args.samples, args.reps)
    items = trajectories(n)
    rec = recipe()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0, concurrency_groups=HEALTH)(BenchRewardWorker)
        workers = [actor.remote(rec) for _ in range(args.workers)]
        ray.get([w.verify.remote(items[:4]) for w in workers])  # start each actor's child (spawn + sympy import)
        ray.get([w.verify_each.remote(items[:2]) for w in workers])
        per_sample, a = timed(lambda xs: ray.get(workers[0].verify_each.remote(xs)), items, reps)
        batched, b = timed(lambda xs: ray.get(workers[0].verify.remote(xs)), items, reps)
        k = len(workers)

        def split_over_workers(xs):
            out = [None] * len(xs)
            for i, part in enumerate(ray.get([w.verify.remote(xs[i::k]) for i, w in enumerate(workers)])):
                out[i::k] = part
            return out

        split, c = timed(split_over_workers, items, reps)
        here, d = timed(RewardWorker(rec).verify, items, reps)
    finally:
        ray.shutdown()
    same = a == b == c == d
    correct = sum(v.correct for v in b)
    print(f"{n} verdicts ({correct} correct); ms of wall time per verdict: one child call each {per_sample:.3f}, "
          f"the batch in one child call {batched:.3f}, split over {k} actors {split:.3f}, on the main thread "
          f"{here:.3f}; same verdicts {same}", flush=True)
    print(f"RESULT per_sample_ms={per_sample:.4g} batched_ms={batched:.4g} batched_{k}_workers_ms={split:.4g} "
          f"main_thread_ms={here:.4g} same_verdicts={int(same)}", flush=True)


if __name__ == "__main__":
    main()

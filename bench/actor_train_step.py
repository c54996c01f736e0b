"""One GRPO train step (`PolicyWorker.train_step`) on the same synthetic batch in a Ray actor as the runtime makes
it (threaded: the `health` concurrency group), in a plain actor and in-process, in that order (issue #15: the actor's
train phase was ~2x the in-process one in bench/async_dispatch.py).

    python bench/actor_train_step.py --quick          # CPU, tiny shape, under a minute here
    python bench/actor_train_step.py                  # GPU: bench/async_dispatch.py's recorded shape, bf16

Each arm builds its worker, takes 2 untimed steps, then times `--steps` steps inside the worker (device-synced)
and `--steps` as the driver sees them (round trip included). The batch: 256 rows of 16 prompt tokens and long-tail
responses (log-normal around 32 tokens, as the dispatch bench's workload), random ids, behaviour log-probs,
advantages and MoE routing traces. The in-process arm runs last, in the driver, after the actors are gone; it is
a process that the two steps before have warmed for *these* shapes, as the actors are for theirs.
Last line: RESULT threaded_ms=.. plain_ms=.. inprocess_ms=.. threaded_over_inprocess=.. (medians inside the worker)

    python bench/actor_train_step.py --fresh-lengths  # in-process, a new batch (new lengths) every step

`--fresh-lengths` measures what the runtime meets instead: every step a batch never seen (new seed, so new
micro-batch lengths), in one process, with micro-batch lengths padded to buckets of 64 (`Trainer.seq_bucket`) or
not (bucket 1), and on CUDA with training attention on flash kernels (the default) or on cuDNN's
(`Trainer.cudnn_attention`), which build a graph for every new length, once per process (rl/train/trainer.py
SEQ_BUCKET_CUDNN); each arm `--steps` steps after 2 untimed, the arms in turn `--passes` times.
Last line: RESULT <kernels>_bucket<n>_ms=.. for each arm, then each over the first arm (medians of the last pass)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_dispatch import recipe_for  # noqa: E402

from rl.runtime.groups import HEALTH  # noqa: E402
from rl.train.trainer import TrainBatch  # noqa: E402
from rl.runtime.worker import PolicyWorker  # noqa: E402


class TimedWorker(PolicyWorker):
    """A PolicyWorker that times its own train steps."""

    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def timed_steps(self, batch: TrainBatch, stage, n: int) -> list[float]:
        cuda = self.recipe.run.device == "cuda"
        out = []
        for _ in range(n):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.train_step(batch, stage)
            if cuda:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out


def synthetic_batch(vocab: int, layers: int, max_tokens: int, rows: int = 256, seed: int = 0) -> TrainBatch:
    rng, g = random.Random(seed), np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(rows):
        prompts.append([rng.randrange(vocab) for _ in range(16)])
        n = max(1, min(int(rng.lognormvariate(0, 1.0) * 32), max_tokens - 16))
        responses.append([rng.randrange(vocab) for _ in range(n)])
    traces = [g.integers(0, 4, (len(p) + len(r) - 1, layers, 2)).astype(np.int16) for p, r in zip(prompts, responses)]
    return TrainBatch(prompts, responses, float(sum(map(len, responses))), routing_B=traces,
                      behavior_logprobs_B=[[-rng.random() * 3 for _ in r] for r in responses],
                      versions_B=[[0] * len(r) for r in responses], advantages_B=[rng.gauss(0, 1) for _ in responses])


def arm(name: str, call, batch: TrainBatch, stage, steps: int) -> float:
    call("begin_stage", stage)
    call("timed_steps", batch, stage, 2)
    inside = call("timed_steps", batch, stage, steps)
    outside = []
    for _ in range(steps):
        t0 = time.perf_counter()
        call("train_step", batch, stage)
        outside.append(time.perf_counter() - t0)
    print(f"{name:<10} ms per step inside the worker {statistics.median(inside) * 1e3:8.1f} "
          f"({' '.join(f'{x * 1e3:.0f}' for x in inside)}); as the driver sees it {statistics.median(outside) * 1e3:8.1f}",
          flush=True)
    return statistics.median(inside)


def fresh_lengths(recipe, shape, steps: int, passes: int) -> None:
    """In-process, a new batch every step: each arm (attention kernels x length bucket) in turn, `passes` times."""
    stage = recipe.stages[0]
    worker = TimedWorker(recipe, rank=0, world_size=1, num_threads=shape.threads)
    worker.begin_stage(stage)
    vocab, seed, res = worker.vocab_size(), 0, {}
    cuda = shape.device == "cuda"
    arms = [(a, b) for a in (("flash", "cudnn") if cuda else ("sdpa",)) for b in (64, 1)]
    for p in range(passes):
        for kernels, bucket in arms:
            worker.trainer.seq_bucket, worker.trainer.cudnn_attention = bucket, kernels == "cudnn"
            times = []
            for _ in range(steps + 2):
                seed += 1
                batch = synthetic_batch(vocab, shape.layers, shape.max_tokens, seed=seed)
                times += worker.timed_steps(batch, stage, 1)
            res[f"{kernels}_bucket{bucket}"] = statistics.median(times[2:])
            print(f"pass {p + 1} {kernels:<5} bucket {bucket:<3} ms per step {res[f'{kernels}_bucket{bucket}'] * 1e3:8.1f} "
                  f"({' '.join(f'{x * 1e3:.0f}' for x in times)})", flush=True)
    first = f"{arms[0][0]}_bucket64"
    ratios = " ".join(f"{k}_over_{first}={v / res[first]:.3f}" for k, v in res.items() if k != first)
    print("RESULT " + " ".join(f"{k}_ms={v * 1e3:.1f}" for k, v in res.items()) + " " + ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, tiny shape")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fresh-lengths", action="store_true", help="in-process, a new batch every step: the attention "
                    "kernels (flash, cuDNN) x the length bucket (64, 1)")
    ap.add_argument("--passes", type=int, default=2, help="--fresh-lengths: run the arms this many times in turn (the "
                    "last pass's medians are reported)")
    a = ap.parse_args()
    if a.steps < 1 or a.passes < 1:
        ap.error(f"--steps and --passes must be at least 1, got {a.steps} and {a.passes}")
    cuda = not a.quick and torch.cuda.is_available()
    shape = argparse.Namespace(device="cuda" if cuda else "cpu", hidden=1024 if cuda else 64, layers=8 if cuda else 2,
                               heads=8 if cuda else 4, prompts=32, group=8, median=32, max_tokens=512 if cuda else 160,
                               threads=8 if cuda else 1, micro_batch=32, steps=6, dtype="bfloat16" if cuda else None,
                               ffn="moe", sigma=1.0, ray=True)
    if a.fresh_lengths:
        return fresh_lengths(recipe_for("sample", shape, ray=False), shape, a.steps, a.passes)
    recipe = recipe_for("sample", shape, ray=True)
    stage = recipe.stages[0]
    import ray

    # the actors import this module by name (bench/ on their path)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent),
                                                os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    res, batch = {}, None
    for name, options in (("threaded", {"concurrency_groups": HEALTH}), ("plain", {})):
        actor = ray.remote(num_cpus=2, num_gpus=int(cuda), **options)(TimedWorker).remote(
            recipe, rank=0, world_size=1, num_threads=shape.threads)
        batch = batch or synthetic_batch(ray.get(actor.vocab_size.remote()), shape.layers, shape.max_tokens)
        res[name] = arm(name, lambda m, *x, w=actor: ray.get(getattr(w, m).remote(*x)), batch, stage, a.steps)
        ray.kill(actor)
    ray.shutdown()
    local = TimedWorker(recipe, rank=0, world_size=1, num_threads=shape.threads)
    res["inprocess"] = arm("inprocess", lambda m, *x: getattr(local, m)(*x), batch, stage, a.steps)
    print(f"RESULT threaded_ms={res['threaded'] * 1e3:.1f} plain_ms={res['plain'] * 1e3:.1f} "
          f"inprocess_ms={res['inprocess'] * 1e3:.1f} threaded_over_inprocess={res['threaded'] / res['inprocess']:.3f}")


if __name__ == "__main__":
    main()

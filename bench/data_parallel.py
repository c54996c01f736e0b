"""Data-parallel training on 1 and 2 policy workers side by side (issue #17 evidence; rl/train/parallel.py).

    python bench/data_parallel.py --quick                        # CPU, gloo, tiny model: the plumbing, < 1 min
    python bench/data_parallel.py --device cuda                  # 2 GPUs, NCCL: the Qwen3-0.6B body, bf16
    python bench/data_parallel.py --device cuda --parallel fsdp2 [--steps 20 --json out.json]

One recipe (a forced-length long-tail task, rewards/longtail.py, so response lengths do not depend on what
the policy learns; an SFT stage on its demonstrations, then an async GRPO stage) runs three times, each a
job on Ray workers in one Ray session:
  one      1 worker,  SFT batch B,  GRPO P prompts per step
  strong   2 workers, SFT batch B,  GRPO P prompts per step   (fixed global batch: strong scaling)
  weak     2 workers, SFT batch 2B, GRPO 2P prompts per step  (fixed per-worker batch: weak scaling)
Per run: trained samples/s of each stage in steady state (the samples of steps 2..n over the time from step
1's end to step n's end: the first step's warm-up and the stage-end evaluation are left out; for GRPO the
time includes the rollout between steps), and whether the workers' weights are identical at the
end (checksum). `one` and `strong` train on the same SFT demonstrations in the same order (the split over
workers does not change what a step sums), so their per-step SFT losses differ only by floating-point order:
`max_loss_diff` is the largest |difference| over the SFT steps. (GRPO losses of the two differ by sampling:
the engines see different shares of the prompts, so they are not compared.)

Scaling ratios are the 2-worker run's samples/s over `one`'s: weak ideal 2.0, strong ideal 2.0 when the step
is compute-bound. On the 2-core CPU the two workers share the cores the one worker had (1 thread each instead
of 2), so CPU figures show the plumbing, not a speed-up.
Last line: RESULT workers=1,2 parallel=.. sft_samples_s_1=.. sft_samples_s_2_strong=.. sft_samples_s_2_weak=..
grpo_samples_s_1=.. grpo_samples_s_2_strong=.. grpo_samples_s_2_weak=.. weak_scaling=.. strong_scaling=..
max_loss_diff=.. weights_identical=<0|1> trainer_state_mib_1=.. trainer_state_mib_2=.. peak_gib_1=.. peak_gib_2=..
allreduce_gbps=.. (per worker: the trainer's parameters, gradients and optimizer state, and the peak device
memory; and the 2-rank all-reduce bandwidth of the link, measured first)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rl.algo.async_grpo import run_async_grpo
from rl.config import Recipe
from rl.algo.driver import run_sft
from rl.algo.job import open_job

SHAPES = {  # name -> model fields; the char tokenizer sets the vocabulary (model.vocab_size must equal it)
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 ffn={"type": "dense", "intermediate_size": 128}),
    "qwen3": dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True,
                  ffn={"type": "dense", "intermediate_size": 3072}, rope_theta=1e6),  # Qwen3-0.6B's body
}


def recipe_for(a, workers: int, scale: int) -> Recipe:
    """The bench recipe on `workers` workers with `scale` x the base per-step batches."""
    inflight = scale * a.prompts * a.group
    return Recipe.model_validate({
        "run": {"name": f"dp{workers}x{scale}", "seed": 0, "device": a.device, "dtype": a.dtype, "num_threads": a.threads},
        "model": {**SHAPES[a.shape], "max_position_embeddings": a.max_tokens + 32},
        "datasets": [{"type": "longtail", "median_tokens": a.median, "sigma": a.sigma, "max_tokens": a.max_tokens,
                      "num_heldout": 4}],
        "engine": {"max_batch_size": -(-inflight // workers), "block_size": 16, "max_seq_len": a.max_tokens + 32},
        "runtime": {"ray": True, "num_workers": workers, "parallel": a.parallel, "cpus_per_worker": a.cpus_per_worker,
                    "worker_timeout_s": 600},
        "stages": [{"type": "sft", "max_steps": a.sft_steps, "batch_size": scale * a.sft_batch, "micro_batch_size": a.micro_batch,
                    "optim": {"lr": a.sft_lr}, "log_every": 1},
                   {"type": "grpo", "max_steps": a.steps, "prompts_per_step": scale * a.prompts, "group_size": a.group,
                    "micro_batch_size": a.micro_batch, "optim": {"lr": a.grpo_lr},
                    "dispatch": {"policy": "sample", "max_inflight": inflight}}],
        "eval": {"max_problems": 2},
        "logging": {"wandb": False, "progress_bar": False},
    })


def run(name: str, a, workers: int, scale: int, out: Path) -> dict:
    recipe = recipe_for(a, workers, scale)
    run_dir = out / name
    run_dir.mkdir(parents=True)
    sft, grpo = recipe.stages
    with open_job(recipe, run_dir, checkpoints=False, say=lambda _: None) as job:
        t0 = time.perf_counter()
        run_sft(job, sft, 0)
        t1 = time.perf_counter()
        run_async_grpo(job, grpo, 1)
        t2 = time.perf_counter()
        infos = job.policy.info()
        checksums = [i["weights_checksum"] for i in infos]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft_steps = [r for r in logged if "sft/loss" in r]  # every step is logged (log_every 1), with its time
    grpo_steps = [r for r in logged if "rl/loss" in r]
    row = {"run": name, "workers": workers,
            "sft_samples_s": steady_rate(sft_steps, sft.batch_size),
            "grpo_samples_s": steady_rate(grpo_steps, grpo.prompts_per_step * grpo.group_size),
            "sft_s": t1 - t0, "grpo_s": t2 - t1, "sft_loss": [r["sft/loss"] for r in sft_steps],
            "weights_identical": int(len(set(checksums)) == 1),
            # per worker: the trainer's parameters + gradients + optimizer state (rl/parallel.trainer_state_bytes),
            # and the peak device memory (engine copy and KV pool included; 0 on CPU)
            "trainer_state_mib": max(i["trainer_state_bytes"] for i in infos) / 2**20,
            "peak_gib": max(i["peak_device_bytes"] for i in infos) / 2**30}
    print(f"[{name}] " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                                  if k != "sft_loss"), flush=True)
    return row


def steady_rate(steps: list[dict], samples_per_step: int) -> float:
    """Samples trained per second between the first and the last step's log time: the first step (allocator,
    lazy initialisation in fresh worker processes) and the stage-end evaluation stay out of the figure."""
    if len(steps) < 2:
        raise SystemExit("data_parallel: need at least 2 steps per stage to time them")
    return (len(steps) - 1) * samples_per_step / (steps[-1]["time"] - steps[0]["time"])


def _allreduce_rank(rank: int, port: int, device: str, nbytes: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=f"cuda:{rank}" if device == "cuda" else "cpu")
    dist.all_reduce(x)  # warm-up (NCCL builds its communicator here)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    seconds = (time.perf_counter() - t0) / iters
    if rank == 0:
        out.put(nbytes / seconds / 1e9)  # algorithm bandwidth; a 2-rank ring moves 2·(n-1)/n = 1x of it per rank
    dist.destroy_process_group()


def allreduce_gbps(device: str, nbytes: int, iters: int = 10) -> float:
    """GB/s of a 2-rank all-reduce of `nbytes` float32 (NCCL between GPUs 0 and 1, gloo on CPU): how fast
    the link the gradient all-reduce takes is (a DDP step all-reduces the trainer's fp32 gradients once)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, device, nbytes, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    value = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes; under a minute on a 2-core CPU")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp2"])
    ap.add_argument("--shape", choices=list(SHAPES), help="default: qwen3 on cuda, tiny on cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the run (split over the workers)")
    ap.add_argument("--cpus-per-worker", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=16, help="GRPO groups per step of the 1-worker run")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps")
    ap.add_argument("--sft-batch", type=int, default=64, help="SFT demonstrations per step of the 1-worker run")
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--sft-lr", type=float, default=1e-5, help="small: the loss curves compared must not spike")
    ap.add_argument("--grpo-lr", type=float, default=1e-6)
    ap.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward")
    ap.add_argument("--median", type=int, default=64)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    a = ap.parse_args()
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    a.shape = a.shape or ("qwen3" if a.device == "cuda" else "tiny")
    if a.quick:
        a.prompts, a.group, a.steps, a.sft_batch, a.sft_steps, a.micro_batch = 4, 4, 5, 16, 5, 8
        a.median, a.max_tokens, a.cpus_per_worker = 8, 32, 0.5

    link = allreduce_gbps(a.device, (16 if a.quick else 1024) * 2**20)
    print(f"all-reduce of {16 if a.quick else 1024} MiB between 2 ranks ({'NCCL' if a.device == 'cuda' else 'gloo'}): "
          f"{link:.1f} GB/s", flush=True)

    import ray

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)  # GPUs: Ray finds them
    out = Path(tempfile.mkdtemp(prefix="data_parallel_"))
    try:
        rows = [run("one", a, 1, 1, out), run("strong", a, 2, 1, out), run("weak", a, 2, 2, out)]
    finally:
        ray.shutdown()
    by = {r["run"]: r for r in rows}
    diff = max(abs(x - y) for x, y in zip(by["one"]["sft_loss"], by["strong"]["sft_loss"], strict=True))
    print(f"{a.shape} shape, {a.dtype}, {a.device}, {a.parallel}; long-tail lengths median {a.median}, max {a.max_tokens}; "
          f"1-worker batches: SFT {a.sft_batch} x {a.sft_steps} steps, GRPO {a.prompts}x{a.group} x {a.steps} steps")
    cols = ["run", "workers", "sft_samples_s", "grpo_samples_s", "sft_s", "grpo_s", "weights_identical",
            "trainer_state_mib", "peak_gib"]
    print(" | ".join(c.rjust(14) for c in cols))
    for r in rows:
        print(" | ".join((f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])).rjust(14) for c in cols))
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "rows": rows}, indent=2))
    one, strong, weak = by["one"], by["strong"], by["weak"]
    print(f"RESULT workers=1,2 parallel={a.parallel} sft_samples_s_1={one['sft_samples_s']:.2f} "
          f"sft_samples_s_2_strong={strong['sft_samples_s']:.2f} sft_samples_s_2_weak={weak['sft_samples_s']:.2f} "
          f"grpo_samples_s_1={one['grpo_samples_s']:.2f} grpo_samples_s_2_strong={strong['grpo_samples_s']:.2f} "
          f"grpo_samples_s_2_weak={weak['grpo_samples_s']:.2f} "
          f"weak_scaling={weak['grpo_samples_s'] / one['grpo_samples_s']:.2f} "
          f"strong_scaling={strong['grpo_samples_s'] / one['grpo_samples_s']:.2f} max_loss_diff={diff:.2e} "
          f"weights_identical={int(strong['weights_identical'] and weak['weights_identical'])} "
          f"trainer_state_mib_1={one['trainer_state_mib']:.1f} trainer_state_mib_2={strong['trainer_state_mib']:.1f} "
          f"peak_gib_1={one['peak_gib']:.2f} peak_gib_2={strong['peak_gib']:.2f} allreduce_gbps={link:.1f}")


if __name__ == "__main__":
    main()

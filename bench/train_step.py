"""The trainer's step alone: where a GRPO or SFT step's time goes (rl/train/trainer.py), at several micro-batch sizes
side by side in one run.

    python bench/train_step.py --quick                       # CPU, tiny shape: the plumbing, < 1 min
    python bench/train_step.py                               # GPU: SmolLM2-135M's shape, bf16 autocast
    python bench/train_step.py --shape qwen3 --micro 32,128 --profile

One step = what `PolicyWorker.train_step` runs: the micro-batch loop (pack, forward, token log-probs, the GRPO
loss of rl/train/losses.py or SFT's cross-entropy, backward), then clipping and AdamW. The batch is synthetic: `--samples`
rows of `--prompt` prompt tokens and response lengths drawn around `--response` (random ids, random behaviour
log-probs and advantages), the shape of the SmolLM2 GRPO recipe's step (32 prompts x 8 samples). Per micro-batch
size: ms per step (median of `--steps` after one warm-up step), trained tokens/s (prompt + response, as
`train/tokens_per_s` counts them), and, with `--profile`, the step's kernel launches and the device-busy share
(sum of device kernel time over the step's wall time: a step far below 1 is bound by the host launching kernels).
Last line: RESULT shape=.. objective=.. micro=<m1>,<m2>,.. ms_per_step=<t1>,<t2>,.. tokens_per_s=<..>,<..>
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import SHAPES  # noqa: E402  (bench/engine.py: the published architectures' shapes)

from model.config import ModelConfig  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from rl.config import GRPOStage, OptimConfig, SFTStage  # noqa: E402
from rl.train.objectives import build_objective  # noqa: E402
from rl.train.trainer import TrainBatch, Trainer  # noqa: E402


def synthetic_batch(a, vocab: int, objective: str) -> TrainBatch:
    rng = random.Random(0)
    prompts, responses = [], []
    for _ in range(a.samples):
        prompts.append([rng.randrange(vocab) for _ in range(a.prompt)])
        n = max(1, min(int(rng.lognormvariate(0, 0.5) * a.response), 4 * a.response))
        responses.append([rng.randrange(vocab) for _ in range(n)])
    tokens = float(sum(map(len, responses)))
    if objective == "sft":
        return TrainBatch(prompts, responses, tokens)
    return TrainBatch(prompts, responses, tokens,
                      behavior_logprobs_B=[[-rng.random() * 3 for _ in r] for r in responses],
                      versions_B=[[0] * len(r) for r in responses],
                      advantages_B=[rng.gauss(0, 1) for _ in responses])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(a, micro: int, batch: TrainBatch) -> dict:
    torch.manual_seed(0)
    model = Decoder(ModelConfig(**SHAPES[a.shape], max_position_embeddings=a.prompt + 4 * a.response + 8)).to(a.device)
    bf16 = a.dtype == "bfloat16"
    trainer = Trainer(model, OptimConfig(lr=1e-6), device=a.device, autocast=torch.bfloat16 if bf16 else None)
    stage = (SFTStage(micro_batch_size=micro) if a.objective == "sft" else GRPOStage(micro_batch_size=micro))
    objective = build_objective(stage, model=model, temperature=1.0, current_version=0)
    trainer.train_step(batch, objective)  # warm-up: allocator, lazy init, autotuning
    times = []
    for _ in range(a.steps):
        sync(a.device)
        t0 = time.perf_counter()
        trainer.train_step(batch, build_objective(stage, model=model, temperature=1.0, current_version=0))
        sync(a.device)
        times.append(time.perf_counter() - t0)
    row = {"micro": micro, "ms": statistics.median(times) * 1e3}
    row["tokens_per_s"] = batch.sequence_tokens / (row["ms"] / 1e3)
    if a.profile:
        row.update(profile_step(a, trainer, batch, stage, model))
    del trainer, model
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_step(a, trainer: Trainer, batch: TrainBatch, stage, model: Decoder) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    sync(a.device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        trainer.train_step(batch, build_objective(stage, model=model, temperature=1.0, current_version=0))
        sync(a.device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    out = {"profiled_ms": wall * 1e3}
    if a.device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels"] = sum(e.count for e in kernels)
        out["device_busy"] = sum(e.self_device_time_total for e in kernels) / 1e6 / wall
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: a.top]
    out["top_cpu"] = [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in top]
    if a.device == "cuda":
        topd = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[: a.top]
        out["top_device"] = [(e.key, e.count, round(e.self_device_time_total / 1e3, 2)) for e in topd]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape on CPU, few rows: under a minute here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on cuda (autocast over fp32 "
                    "master weights, as run.dtype bfloat16 trains), float32 on cpu")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--objective", choices=["grpo", "sft"], default="grpo")
    ap.add_argument("--samples", type=int, default=256, help="rows per step (the SmolLM2 GRPO recipe: 32 x 8)")
    ap.add_argument("--prompt", type=int, default=80, help="prompt tokens per row")
    ap.add_argument("--response", type=int, default=40, help="median response tokens per row (log-normal)")
    ap.add_argument("--micro", default="32,64,128,256", help="micro-batch sizes to compare (rows per forward/backward)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per micro-batch size")
    ap.add_argument("--profile", action="store_true", help="profile one more step per size (torch.profiler)")
    ap.add_argument("--top", type=int, default=8, help="ops listed per profile")
    a = ap.parse_args()
    if a.quick:
        a.device, a.shape, a.samples, a.prompt, a.response, a.micro, a.steps = "cpu", "tiny", 32, 16, 8, "8,32", 3
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    micros = [int(m) for m in a.micro.split(",")]
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    batch = synthetic_batch(a, SHAPES[a.shape]["vocab_size"], a.objective)
    print(f"{a.shape} shape, {a.device}, {a.dtype}, {a.objective}: {a.samples} rows, {batch.sequence_tokens} tokens "
          f"per step ({sum(map(len, batch.responses_B))} response)", flush=True)
    rows = []
    for m in micros:
        row = time_steps(a, m, batch)
        rows.append(row)
        extra = "".join(f"  {k}={row[k]:.3g}" for k in ("profiled_ms", "kernels", "device_busy") if k in row)
        print(f"micro {m:4d}: {row['ms']:9.1f} ms/step  {row['tokens_per_s']:10.0f} tokens/s{extra}", flush=True)
        for key in ("top_cpu", "top_device"):
            for name, count, ms in row.get(key, []):
                print(f"    {key[4:]:6s} {ms:9.2f} ms  x{count:<6d} {name[:90]}")
    print(f"RESULT shape={a.shape} objective={a.objective} micro={','.join(str(r['micro']) for r in rows)} "
          f"ms_per_step={','.join('%.1f' % r['ms'] for r in rows)} "
          f"tokens_per_s={','.join('%.0f' % r['tokens_per_s'] for r in rows)}")


if __name__ == "__main__":
    main()

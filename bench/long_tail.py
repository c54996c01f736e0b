"""Rollouts at the lengths RL uses, under KV memory pressure (issue #42): long-tail responses whose lengths the engine
does not know in advance, as many samples in flight as the KV budget allows, GRPO training between rollout phases.

    python bench/long_tail.py --quick                                     # CPU, tiny shape, a pool that forces parking
    python bench/long_tail.py --shape qwen3-1.7b --kv-gib 60 --kv bf16,fp4   # one GPU: the issue's workload

The workload: a dense policy with random weights, prompts of --prompt tokens, response lengths log-normal (median
--median, σ 0.99: p99 ~10x the median) capped at --cap. Every request carries the cap as its max_new_tokens; a
sample ends at its drawn length as if the policy had sampled EOS there (rewards/longtail.py `mode: eos`,
GenerationRequest.eos_at), so the engine learns a length only when it comes: its admission and KV allocation
cannot plan for it (today's forced-length mode hands the length to the engine as max_new_tokens, which hides the
problem). The KV pool is --kv-gib of the stated format; `max_inflight` defaults to the samples that budget holds at
the prompt plus twice the median (a sample in flight holds about that on average: long samples stay longer).

Per arm (a dispatch policy and a KV format), one in-process GRPO job with the trainer's full state resident:
decoding samples per engine step (mean, and the share of rollout calls within 5% of the in-flight bound; parked
samples do not decode), KV utilisation (tokens held / pool capacity, averaged over rollout calls), parks and their
bytes, rollout tokens/s, trained samples/s and tokens/s (over the rollout phases and train steps), and the trained samples' mean length
against the drawn lengths' (no arm may win by training short samples). --quick also checks on the engine alone that
a pressured pool generates the tokens a roomy one does.

Last line: RESULT inflight_mean=<x> inflight_held=<f> kv_used_frac=<f> parked_total=<n> tokens_equal_unpressured=<0|1>
(the first arm's), and with several arms sample_over_sync=<r> (trained tokens/s) and inflight_mean_fp4=<x>.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.kv_cache import kv_format  # noqa: E402
from rl.algo.async_grpo import run_async_grpo  # noqa: E402
from rl.algo.job import open_job  # noqa: E402
from rl.config import Recipe  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 ffn={"type": "dense", "intermediate_size": 128}),
    "qwen3-1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       ffn={"type": "dense", "intermediate_size": 6144}, qk_norm=True, rope_theta=1e6),
}
"""Model shapes; the vocabulary is the char tokenizer's (99 ids): the output head is not what this bench measures
(KV memory and concurrency), and the forced ends need no real tokens."""
SIGMA = math.log(10) / 2.326  # p99 / p50 = 10


def kv_bytes_per_token(shape: dict, kv: str, dtype: str) -> float:
    import torch

    return shape["num_layers"] * kv_format(kv).bytes_per_token_per_layer(shape["num_kv_heads"], shape["head_dim"],
                                                                          getattr(torch, dtype))


def recipe_for(a, policy: str, kv: str, num_blocks: int, inflight: int) -> Recipe:
    shape = SHAPES[a.shape]
    return Recipe.model_validate({
        "run": {"name": f"longtail-{policy}-{kv}", "seed": 0, "device": a.device, "dtype": a.dtype, "num_threads": a.threads},
        "model": {**shape, "max_position_embeddings": a.prompt + a.cap + 16, "kv_cache": {"dtype": kv}},
        "datasets": [{"type": "longtail", "median_tokens": a.median, "sigma": SIGMA, "max_tokens": a.cap, "mode": "eos",
                      "prompt_tokens": a.prompt}],
        "engine": {"max_batch_size": inflight, "block_size": 16, "num_blocks": num_blocks, "max_seq_len": a.prompt + a.cap + 1,
                   "max_new_tokens": a.cap},
        "runtime": {"ray": False},
        "stages": [{"type": "grpo", "max_steps": a.steps, "prompts_per_step": a.prompts, "group_size": a.group,
                    "optim": {"lr": 1e-6}, "steps_per_call": 4,
                    "dispatch": {"policy": policy, "max_inflight": inflight, "max_version_lag": a.lag}}],
        "logging": {"wandb": False, "progress_bar": False},
        "checkpoint": {"every_steps": 0},
        "eval": {"max_problems": 1},
    })


def run_arm(a, policy: str, kv: str, out: Path) -> dict:
    per_token = kv_bytes_per_token(SHAPES[a.shape], kv, a.dtype)
    num_blocks = int(a.kv_gib * 2**30 // (16 * per_token))
    pool_tokens = num_blocks * 16
    # as many as the pool holds at the prompt plus the median: in flight a sample holds ~1.3x the median on average
    # (H200, bf16: 0.54 of the pool used at prompt + 2x median), so the pool runs full and the engine parks the surplus
    inflight = a.max_inflight or max(a.prompts * a.group, pool_tokens // (a.prompt + a.median) // a.group * a.group)
    recipe = recipe_for(a, policy, kv, num_blocks, inflight)
    run_dir = out / f"{policy}-{kv}"
    with open_job(recipe, run_dir, checkpoints=False, say=lambda m: None) as job:
        t0 = time.perf_counter()
        clock = run_async_grpo(job, recipe.stages[0], 0).clock
        wall = time.perf_counter() - t0
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        trained = [n for (n,) in c.execute("select length(response_tokens) from samples where train_step is not null")]
        by_step: dict[int, int] = {}
        for step, n in c.execute("select train_step, length(response_tokens) / 4 from samples where train_step is not null"):
            by_step[step] = by_step.get(step, 0) + n  # int32 token ids in the store's blob
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"rl/loss"' in x]
    conc = clock.concurrency
    tokens_trained = sum(trained) / 4  # int32 token ids in the store's blob
    # steady: the steps after the first (the first pays the ramp-up of the in-flight samples and the engine's graph
    # captures, which a long job pays once), per second of their rollout phases and train steps
    later = steps[1:]
    steady_s = (later[-1]["time/rollout_s"] + later[-1]["time/train_s"] - steps[0]["time/rollout_s"]
                - steps[0]["time/train_s"]) if later else 0.0
    steady = sum(n for st, n in by_step.items() if st > min(by_step)) / steady_s if steady_s > 0 else float("nan")
    return {
        "arm": f"{policy}/{kv}", "pool_tokens": pool_tokens, "max_inflight": inflight,
        "inflight_mean": clock.concurrency_mean,
        "inflight_held": sum(c >= 0.95 * inflight for c in conc) / max(len(conc), 1),
        "kv_used_frac": clock.kv_used_sum / max(clock.kv_used_calls, 1),
        "parks": clock.parks, "parked_gib": clock.parked_bytes / 2**30,
        "rollout_tokens_per_s": clock.generated_tokens / max(clock.rollout_s, 1e-9),
        # per second of the stage's rollout phases and train steps (not its start or its closing evaluation)
        "trained_samples_per_s": len(trained) / (clock.rollout_s + clock.train_s),
        "trained_tokens_per_s": tokens_trained / (clock.rollout_s + clock.train_s),
        "steady_trained_tokens_per_s": steady,
        "trained_len_mean": tokens_trained / max(len(trained), 1), "rollout_s": clock.rollout_s, "train_s": clock.train_s,
        "wall_s": wall,
    }


def drawn_len_mean(a, n: int = 20000) -> float:
    """The mean of the length distribution the task draws from (capped), by sampling it as the task does."""
    import random

    rng = random.Random(0)
    return statistics.fmean(max(1, min(a.cap, round(math.exp(math.log(a.median) + SIGMA * rng.gauss(0, 1)))))
                            for _ in range(n))


def tokens_equal_unpressured(a) -> int:
    """The engine alone, the same requests (capped, ended at drawn lengths) through a pool that forces parking and
    one that never does: 1 when every sample's tokens are equal."""
    import torch

    from model.config import ModelConfig
    from model.decoder import Decoder
    from rollout.config import EngineConfig
    from rollout.engine import Engine
    from rollout.types import GenerationRequest

    torch.manual_seed(0)
    model = Decoder(ModelConfig(**{**SHAPES["tiny"], "vocab_size": 99,
                                   "max_position_embeddings": a.prompt + a.cap + 16})).eval()
    rng = __import__("random").Random(1)
    reqs = [GenerationRequest(f"r{i}", tuple(rng.randrange(3, 90) for _ in range(a.prompt)), a.cap, seed=i,
                              eos_at=max(1, min(a.cap, round(math.exp(math.log(a.median) + SIGMA * rng.gauss(0, 1))))))
            for i in range(24)]
    out, parks = [], []
    for blocks in (None, (a.prompt + a.cap) // 16 + 8):
        eng = Engine(model, EngineConfig(max_batch_size=24, block_size=16, max_seq_len=a.prompt + a.cap + 1,
                                         max_new_tokens=a.cap, num_blocks=blocks), eos_id=10**6)
        out.append({g.sample_id: g.response_tokens for g in eng.generate(reqs)})
        parks.append(eng.stats.parks)
    assert parks[0] == 0 and parks[1] > 0, parks
    return int(out[0] == out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, tiny shape, a pool that forces parking: under a minute")
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda")
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--median", type=int, default=1024, help="median response tokens")
    ap.add_argument("--cap", type=int, default=16384, help="every request's max_new_tokens; the longest response")
    ap.add_argument("--kv-gib", type=float, default=60.0, help="the KV pool's budget")
    ap.add_argument("--kv", default="bf16", help="KV formats, comma-separated (bf16, fp8, fp4)")
    ap.add_argument("--policies", default="sample,sync", help="dispatch policies, comma-separated")
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="default: the samples the pool holds at the prompt plus twice the median")
    ap.add_argument("--prompts", type=int, default=32, help="groups per train step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lag", type=int, default=4, help="dispatch.max_version_lag")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                    help="first an untimed one-step job of short samples, which pays the process's one-time costs "
                         "(the trainer's torch.compile, Triton kernels) outside the arms (default: on CUDA)")
    a = ap.parse_args()
    import torch

    if a.quick:
        a.device, a.shape, a.prompt, a.median, a.cap, a.prompts, a.group, a.steps = "cpu", "tiny", 16, 24, 240, 4, 4, 3
        a.kv_gib = 40 * 16 * kv_bytes_per_token(SHAPES["tiny"], "bf16", "float32") / 2**30  # 40 blocks of 16 tokens
        a.max_inflight = a.max_inflight or 16
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    out = Path(tempfile.mkdtemp(prefix="long_tail_"))
    drawn = drawn_len_mean(a)
    print(f"{a.shape} on {a.device} ({a.dtype}), prompts {a.prompt} tokens, responses log-normal median {a.median} "
          f"(p99/p50 10), cap {a.cap} (drawn mean {drawn:.0f}); KV budget {a.kv_gib:.3g} GiB; "
          f"{a.prompts}x{a.group} samples a step, {a.steps} steps", flush=True)
    if a.warmup if a.warmup is not None else a.device == "cuda":
        w = argparse.Namespace(**{**vars(a), "median": 32, "cap": min(a.cap, 256), "prompts": 1, "steps": 1,
                                  "max_inflight": a.group})
        t0 = time.perf_counter()
        run_arm(w, "sample", a.kv.split(",")[0], out / "warmup")
        print(f"warm-up (untimed): {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for kv in a.kv.split(","):
        for policy in a.policies.split(","):
            r = run_arm(a, policy, kv, out)
            rows.append(r)
            print(f"{r['arm']:>12s}: pool {r['pool_tokens']:,} tokens, max_inflight {r['max_inflight']}: decoding "
                  f"{r['inflight_mean']:.1f} a step (held {r['inflight_held']:.2f}), KV used {r['kv_used_frac']:.2f}, "
                  f"parks {r['parks']} ({r['parked_gib']:.2f} GiB), rollout {r['rollout_tokens_per_s']:,.0f} tok/s, "
                  f"trained {r['trained_samples_per_s']:.2f} samples/s {r['trained_tokens_per_s']:,.0f} tok/s "
                  f"(after step 1: {r['steady_trained_tokens_per_s']:,.0f} tok/s) "
                  f"(mean length {r['trained_len_mean']:.0f}; rollout {r['rollout_s']:.1f} s, train {r['train_s']:.1f} s, "
                  f"wall {r['wall_s']:.1f} s)", flush=True)
    first = rows[0]
    result = (f"RESULT inflight_mean={first['inflight_mean']:.1f} inflight_held={first['inflight_held']:.2f} "
              f"kv_used_frac={first['kv_used_frac']:.3f} parked_total={first['parks']}")
    if a.quick:
        result += f" tokens_equal_unpressured={tokens_equal_unpressured(a)}"
    by = {r["arm"]: r for r in rows}
    kv0 = a.kv.split(",")[0]
    if f"sample/{kv0}" in by and f"sync/{kv0}" in by:
        result += f" sample_over_sync={by[f'sample/{kv0}']['trained_tokens_per_s'] / by[f'sync/{kv0}']['trained_tokens_per_s']:.2f}"
        result += (" steady_sample_over_sync="
                   f"{by[f'sample/{kv0}']['steady_trained_tokens_per_s'] / by[f'sync/{kv0}']['steady_trained_tokens_per_s']:.2f}")
    if "sample/fp4" in by:
        result += f" inflight_mean_fp4={by['sample/fp4']['inflight_mean']:.1f}"
    result += f" rollout_tokens_per_s={first['rollout_tokens_per_s']:.0f}"
    print(result)


if __name__ == "__main__":
    main()

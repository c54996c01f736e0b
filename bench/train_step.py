"""The trainer's step alone (rl/train/trainer.py): packed against padded micro-batches, the chunked log-prob path
against materialised logits, side by side in one run, with MFU against this GPU's measured bf16 matmul rate.

    python bench/train_step.py --quick                                   # CPU, tiny shape: the plumbing, < 1 min
    python bench/train_step.py --shape qwen3 --arms padded:32,padded:128,packed:32768
    python bench/train_step.py --shape qwen3-1.7b --lengths longtail --samples 64 --arms padded:8,packed:16384

One step = what `PolicyWorker.train_step` runs: the micro-batch loop (pack, forward, token log-probs, the GRPO loss of
rl/train/losses.py or SFT's cross-entropy, backward), then clipping and AdamW. The batch is synthetic: `--samples`
rows of `--prompt` prompt tokens and responses of `--lengths`: `short`, log-normal around `--response` (the SmolLM2
GRPO recipe's step is 32 x 8 rows of ~80 + ~40 tokens); `longtail`, log-normal with median 1,024 and p99 ~10K tokens,
capped at 16,384 (reasoning RL). The lengths are drawn, not sorted or bucketed for the trainer: it sees them as a
rollout hands them over.

Arms (`--arms`, comma-separated): `padded:<rows>` (rows per micro-batch, each padded to its longest row: the trainer
before issue #41), `padded:<tokens>t` (the same with a padded-token budget: micro_batch_tokens), `packed:<tokens>` (rows back to back up to a token budget, document-masked attention:
model/varlen.py), each optionally `+materialised` (the [tokens, vocab] float32 logits instead of the chunked
log-prob path, model/token_logprobs.py) or `+ckpt` (per-layer activation checkpointing). Every arm starts from the
same weights and runs the same steps. Per arm: ms per step (median of `--steps` after one warm-up step), tokens/s
(the real prompt + response tokens), MFU = 6·N·tokens/s over the measured peak (N: the parameters that do matmuls,
the output head included, the input embedding not; padding and recomputation do not count as work), the device's
peak memory over the arm's steps, and the padded-token share (positions computed that are padding).

Checks in the same run: `packed_equals_padded` (the first padded and the first packed arm take the same first step: the loss and
the gradient, relative difference within 1e-5 in float32, 2e-2 in bf16 autocast, where rounding of different kernels
and sums differs), and `logits_materialised_bytes`: the largest [rows, vocab] tensor any op of a chunked-path step
produces with more rows than one chunk (0: no step ever held the micro-batch's logits); `materialised_arm_bytes` is
the same watch on the `+materialised` arms (non-zero: the watch sees logits where they exist).

Last line: RESULT shape=.. lengths=.. arms=.. ms_per_step=.. tokens_per_s=.. mfu=.. peak_gib=.. padded_share=..
packed_equals_padded=<0|1> logits_materialised_bytes=<n> materialised_arm_bytes=<n> [matmul_tflops=..
mfu_<shape>=<best arm's>]
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import SHAPES  # noqa: E402  (bench/engine.py: the published architectures' shapes)

from model.config import ModelConfig  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from model.token_logprobs import default_chunk_size  # noqa: E402
from rl.config import GRPOStage, OptimConfig, SFTStage  # noqa: E402
from rl.train import objectives  # noqa: E402
from rl.train.objectives import build_objective  # noqa: E402
from rl.train.trainer import TrainBatch, Trainer  # noqa: E402

DATASHEET_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, by device name


def response_lengths(a, rng: random.Random) -> list[int]:
    if a.lengths == "longtail":  # median 1,024, p99 ~10K (σ = ln 10 / 2.326), cap 16,384
        return [max(1, min(a.cap, int(rng.lognormvariate(math.log(1024), math.log(10) / 2.326)))) for _ in range(a.samples)]
    if a.lengths == "cap":  # every response as long as the cap allows: does one such sample train at all?
        return [a.cap - a.prompt] * a.samples
    return [max(1, min(int(rng.lognormvariate(0, 0.5) * a.response), 4 * a.response)) for _ in range(a.samples)]


def synthetic_batch(a, vocab: int) -> TrainBatch:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(a.prompt)] for _ in range(a.samples)]
    responses = [[rng.randrange(vocab) for _ in range(n)] for n in response_lengths(a, rng)]
    tokens = float(sum(map(len, responses)))
    if a.objective == "sft":
        return TrainBatch(prompts, responses, tokens)
    return TrainBatch(prompts, responses, tokens,
                      behavior_logprobs_B=[[-rng.random() * 3 for _ in r] for r in responses],
                      versions_B=[[0] * len(r) for r in responses],
                      advantages_B=[rng.gauss(0, 1) for _ in responses])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parse_arm(text: str) -> dict:
    kind, _, rest = text.partition(":")
    size, *flags = rest.split("+")
    by_tokens = kind == "packed" or size.endswith("t")
    size = size.removesuffix("t")
    if kind not in ("padded", "packed") or not size.isdigit() or set(flags) - {"materialised", "ckpt", "compile",
                                                                               "compileops"}:
        raise SystemExit(f"train_step.py: bad arm {text!r} (padded:<rows>, padded:<tokens>t or packed:<tokens>, "
                         "+materialised, +ckpt, +compile (layers), +compileops)")
    compiled = "layers" if "compile" in flags else "ops" if "compileops" in flags else None
    return {"name": text, "kind": kind, "size": int(size), "tokens": by_tokens, "materialised": "materialised" in flags,
            "ckpt": "ckpt" in flags, "compile": compiled}


def stage_for(a, arm: dict):
    fields = {"packing": arm["kind"]}
    fields.update({"micro_batch_tokens": arm["size"]} if arm["tokens"] else {"micro_batch_size": arm["size"]})
    if a.objective == "sft":
        return SFTStage(**fields)
    return GRPOStage(**fields, activation_checkpointing=arm["ckpt"])


def matmul_flops_params(model: Decoder) -> int:
    """N of 6·N·tokens: every parameter that takes part in a matmul per token (the output head counted once, tied
    or not; the input embedding is a lookup)."""
    n = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        n -= model.model.embed_tokens.weight.numel()
    return n


def measured_matmul_tflops(device: str) -> float:
    """This GPU's bf16 matmul rate now: the best of a few 8192³ matmuls."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - t0) / 5)
    return 2 * 8192**3 / best / 1e12


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor any op produces whose last dimension is the vocabulary and whose rows exceed
    `rows` (the chunked path's own buffers have at most a chunk's rows)."""

    def __init__(self, vocab: int, rows: int):
        super().__init__()
        self.vocab, self.rows, self.largest = vocab, rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # noqa: SLF001  # views and out= writes allocate nothing
            return out
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and \
                    t.numel() // self.vocab > self.rows:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def profile_step(trainer: Trainer, batch: TrainBatch, objective, name: str, top: int = 18) -> None:
    """One step under torch.profiler: the kernels that took the most device time, and their share of it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and trainer.device != "cpu"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        trainer.train_step(batch, objective)
        sync(trainer.device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0 and (not cuda or e.device_type.name == "CUDA")]
    total = sum(getattr(e, attr) for e in events)
    print(f"  profile of {name}: {total / 1e3:.1f} ms of {'device' if cuda else 'CPU'} time in {len(events)} kernels")
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:top]:
        print(f"    {getattr(e, attr) / 1e3:8.1f} ms {getattr(e, attr) / total:6.1%} x{e.count:<5d} {e.key[:110]}")


def padded_share(batch: TrainBatch, plan: list[list[int]], packed: bool) -> float:
    lengths = [len(p) + len(r) - 1 for p, r in zip(batch.prompts_B, batch.responses_B)]
    real = sum(lengths)
    computed = real if packed else sum(len(rows) * max(lengths[i] for i in rows) for rows in plan)
    return 1.0 - real / computed


def run_arm(a, arm: dict, model0: Decoder, batch: TrainBatch) -> dict:
    objectives.LOGPROBS = "materialised" if arm["materialised"] else "chunked"
    model = copy.deepcopy(model0)
    model.compile_for_training(arm["compile"], backend="inductor" if a.device == "cuda" else "aot_eager")
    bf16 = a.dtype == "bfloat16"
    trainer = Trainer(model, OptimConfig(lr=1e-6), device=a.device, autocast=torch.bfloat16 if bf16 else None)
    stage = stage_for(a, arm)

    def make(model=model):  # bound now: `model` is deleted at the end
        return build_objective(stage, model=model, temperature=1.0, current_version=0)

    # the first step's gradient, before any update (the packed-vs-padded check), then the step itself
    first = trainer.accumulate(batch, make())
    grad = torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]).cpu()
    loss = first.sums.get("rl/loss", first.sums.get("sft/loss"))
    trainer.opt.zero_grad(set_to_none=True)
    plan, packed = trainer.micro_batch_plan(batch, make())
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batch, make())  # warm-up: allocator, lazy init, autotuning
    times = []
    split: dict[str, list[float]] = {}
    for _ in range(a.steps):
        sync(a.device)
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch, make())
        sync(a.device)
        times.append(time.perf_counter() - t0)
        for k, v in metrics.shared.items():
            if k.endswith("_s"):
                split.setdefault(k, []).append(v)
    row = {"arm": arm["name"], "ms": statistics.median(times) * 1e3, "loss": loss, "grad": grad,
           "micro_batches": len(plan), "padded_share": padded_share(batch, plan, packed),
           "split_ms": {k.split("/")[1][:-2]: statistics.median(v) * 1e3 for k, v in split.items()}}
    row["tokens_per_s"] = batch.sequence_tokens / (row["ms"] / 1e3)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else float("nan")
    if arm["compile"]:
        stats = torch._dynamo.utils.counters["stats"]  # noqa: SLF001
        print(f"  {arm['name']}: torch.compile made {stats['unique_graphs']} graphs in {stats['calls_captured']} "
              f"captured calls; graph breaks {sum(torch._dynamo.utils.counters['graph_break'].values())}")  # noqa: SLF001
    if a.profile:
        profile_step(trainer, batch, make(), arm["name"])
    if a.watch_logits:
        watch = LargestVocabTensor(model.config.vocab_size, a.chunk_rows)
        with watch:
            trainer.train_step(batch, make())
        row["logits_bytes"] = watch.largest
    del trainer, model
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return row


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
    ap.add_argument("--lengths", choices=["short", "longtail", "cap"], default="short",
                    help="longtail: median 1K, p99 ~10K, capped at --cap; cap: every row --cap tokens, prompt included")
    ap.add_argument("--response", type=int, default=40, help="short: median response tokens per row (log-normal)")
    ap.add_argument("--cap", type=int, default=16384, help="longtail: the longest response")
    ap.add_argument("--arms", help="comma-separated (default: padded:32,padded:128,packed:16384,packed:16384+materialised;"
                    " --quick: padded:8,packed:128,packed:128+materialised)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm")
    ap.add_argument("--kv-gib", type=float, default=0.0, help="GiB held beside the trainer (the recipe's KV pool)")
    ap.add_argument("--profile", action="store_true", help="one more step per arm under torch.profiler: the top kernels")
    ap.add_argument("--no-watch", dest="watch_logits", action="store_false",
                    help="skip the extra step that looks for materialised logits (it runs every op through Python)")
    a = ap.parse_args()
    if a.quick:
        a.device, a.shape, a.samples, a.prompt, a.response, a.steps = "cpu", "tiny", 24, 12, 8, 2
        a.arms = a.arms or "padded:8,packed:128,packed:128+materialised"
    a.arms = a.arms or "padded:32,padded:128,packed:16384,packed:16384+materialised"
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    arms = [parse_arm(t) for t in a.arms.split(",")]
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    cfg = ModelConfig(**SHAPES[a.shape], max_position_embeddings=a.prompt + (a.cap if a.lengths != "short" else 4 * a.response) + 8)
    vocab = cfg.vocab_size
    a.chunk_rows = default_chunk_size(vocab, torch.bfloat16 if a.dtype == "bfloat16" else torch.float32)
    if a.quick:  # the tiny vocabulary's chunks would hold a whole micro-batch: chunk smaller, so the check bites
        a.chunk_rows = objectives.LOGPROB_CHUNK_ROWS = 16
    batch = synthetic_batch(a, vocab)
    torch.manual_seed(0)
    model0 = Decoder(cfg).to(a.device)
    n_params = matmul_flops_params(model0)
    peak = measured_matmul_tflops(a.device) if a.device == "cuda" else float("nan")
    datasheet = next((v for k, v in DATASHEET_TFLOPS.items() if a.device == "cuda" and k in torch.cuda.get_device_name()), float("nan"))
    held = torch.empty(int(a.kv_gib * 2**30), dtype=torch.uint8, device=a.device) if a.kv_gib else None
    lengths = [len(r) for r in batch.responses_B]
    print(f"{a.shape} shape ({n_params / 1e9:.3f}B matmul parameters), {a.device}, {a.dtype}, {a.objective}, "
          f"{a.lengths} lengths: {a.samples} rows, {batch.sequence_tokens} tokens per step (responses: median "
          f"{statistics.median(lengths):.0f}, max {max(lengths)}); bf16 matmul {peak:.0f} TFLOP/s measured, "
          f"{datasheet:.0f} datasheet; {a.kv_gib:g} GiB held beside", flush=True)
    rows = []
    for arm in arms:
        try:
            row = run_arm(a, arm, model0, batch)
        except torch.OutOfMemoryError:
            print(f"{arm['name']:>28s}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001  (a compile arm that fails to compile: say so, measure the others)
            if not arm["compile"]:
                raise
            print(f"{arm['name']:>28s}: failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        tflops = 6 * n_params * row["tokens_per_s"] / 1e12
        row["mfu"] = tflops / peak if peak == peak else float("nan")
        row["mfu_datasheet"] = tflops / datasheet if datasheet == datasheet else float("nan")
        rows.append(row)
        split = " ".join(f"{k} {v:.0f}" for k, v in row["split_ms"].items())
        print(f"{arm['name']:>28s}: {row['ms']:9.1f} ms/step {row['tokens_per_s']:10.0f} tokens/s  "
              f"{tflops:6.1f} TFLOP/s  MFU {row['mfu']:.3f} (datasheet {row['mfu_datasheet']:.3f})  "
              f"peak {row['peak_gib']:.1f} GiB  padded {row['padded_share']:.3f}  micro-batches "
              f"{row['micro_batches']}  [ms: {split}]", flush=True)
    del held
    tol = 1e-5 if a.dtype == "float32" else 2e-2
    padded = next((r for r in rows if r["arm"].startswith("padded")), None)
    packed = next((r for r in rows if r["arm"].startswith("packed")), None)
    equal, diff = 0, float("nan")
    if padded and packed:
        diff = float((packed["grad"] - padded["grad"]).norm() / padded["grad"].norm())
        loss_diff = abs(packed["loss"] - padded["loss"]) / max(abs(padded["loss"]), 1e-12)
        equal = int(diff <= tol and loss_diff <= tol)
        print(f"packed vs padded, first step: gradient relative difference {diff:.2e}, loss {loss_diff:.2e} "
              f"(tolerance {tol:g})")
    watched = [r["logits_bytes"] for r in rows if "logits_bytes" in r and "materialised" not in r["arm"]]
    control = [r["logits_bytes"] for r in rows if "logits_bytes" in r and "materialised" in r["arm"]]
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    speedup = ""
    if padded and best:
        best_padded = max((r for r in rows if r["arm"].startswith("padded")), key=lambda r: r["tokens_per_s"])
        best_packed = max((r for r in rows if r["arm"].startswith("packed")), key=lambda r: r["tokens_per_s"], default=None)
        if best_packed:
            speedup = f" packed_over_padded={best_packed['tokens_per_s'] / best_padded['tokens_per_s']:.2f}"
    extra = ""
    if a.device == "cuda" and best:
        extra = (f" matmul_tflops={peak:.0f} mfu_{a.shape.replace('-', '_').replace('.', 'p')}={best['mfu']:.3f}"
                 f" mfu_datasheet={best['mfu_datasheet']:.3f}")
    print(f"RESULT shape={a.shape} lengths={a.lengths} arms={','.join(r['arm'] for r in rows)} "
          f"ms_per_step={','.join('%.1f' % r['ms'] for r in rows)} "
          f"tokens_per_s={','.join('%.0f' % r['tokens_per_s'] for r in rows)} "
          f"mfu={','.join('%.3f' % r['mfu'] for r in rows)} peak_gib={','.join('%.1f' % r['peak_gib'] for r in rows)} "
          f"padded_share={','.join('%.3f' % r['padded_share'] for r in rows)} grad_rel_diff={diff:.2e} "
          f"packed_equals_padded={equal} logits_materialised_bytes={max(watched) if watched else -1} "
          f"materialised_arm_bytes={max(control) if control else -1}{speedup}{extra}")


if __name__ == "__main__":
    main()

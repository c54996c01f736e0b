"""Full fine-tuning against LoRA side by side (issue #44), through the policy worker's own train step and weight update.

    python bench/lora.py --quick                      # CPU: the SmolLM2-135M shape cut to 6 layers, float32
    python bench/lora.py                              # CPU: the whole SmolLM2-135M shape (~2.5 min)
    python bench/lora.py --shape qwen3 --rank 32      # one GPU: run.dtype bfloat16

Each arm is the policy worker's model on random weights of the shape (no download): `full` trains every weight, `lora` the
adapters of `model.lora` (rank --rank, every linear layer of every decoder layer). Per arm, on the same SFT batches:
the trainer's state after a step (weights, gradients, AdamW moments: rl/train/parallel.py `trainer_state_bytes`),
the median train step, and the median weight update into the engine's copy (`PolicyWorker.update_weights`: a cast
copy of every weight for `full` under bf16, the merged W + s B A of the adapted layers for `lora`; on float32 CPU the
full arm shares its module with the engine and updates nothing). `lora_equals_merged`: the LoRA model's logits
against the plain model of its merged weights (the engine's view) with adapters moved off zero, float32, within
1e-4 (and the adapters move the logits by more than 100x that). Last line:
RESULT lora_equals_merged=<0|1> lora_merged_max_abs_diff=<x> full_over_lora_state_bytes=<r> full_step_ms=<ms>
lora_step_ms=<ms> full_update_ms=<ms> lora_update_ms=<ms>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import SHAPES  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.lora import adapters_off, lora_layers, merged_copy  # noqa: E402
from model.pretrained import build_decoder  # noqa: E402
from rl.config import SFTStage  # noqa: E402
from rl.runtime.worker import refresh_rollout_copy, rollout_copy  # noqa: E402
from rl.train.objectives import build_objective  # noqa: E402
from rl.train.parallel import trainer_state_bytes  # noqa: E402
from rl.train.trainer import TrainBatch, Trainer  # noqa: E402


def build(shape: str, device: str, lora: dict | None, tokens: int, layers: int | None = None):
    """(the trainer's model, the engine's copy or None): random weights of the shape, as `PolicyWorker` builds them
    (rl/runtime/worker.py `build_policy`, `rollout_copy`): a copy under bf16 and with LoRA."""
    torch.manual_seed(0)
    fields = {**SHAPES[shape], "max_position_embeddings": 2 * tokens + 16, **({"lora": lora} if lora else {}),
              **({"num_layers": layers} if layers else {})}
    model = build_decoder(ModelConfig(**fields), device=device)
    bf16 = device == "cuda"
    copy = rollout_copy(model, torch.bfloat16 if bf16 else torch.float32) if bf16 or lora else None
    return model, copy


def batches(vocab: int, rows: int, tokens: int, n: int) -> list[TrainBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, 2 * tokens), generator=g).tolist()
        out.append(TrainBatch([r[:tokens] for r in ids], [r[tokens:] for r in ids], float(rows * tokens)))
    return out


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def arm(shape: str, device: str, lora: dict | None, data: list[TrainBatch], layers: int | None) -> dict:
    """The worker's train step (`Trainer.train_step` with the SFT objective) and weight update (`refresh_rollout_copy`
    after an optimizer step, then the engine's fused weights)."""
    model, engine = build(shape, device, lora, len(data[0].prompts_B[0]), layers)
    stage = SFTStage(max_steps=1000, batch_size=len(data[0]), micro_batch_size=len(data[0]))
    trainer = Trainer(model, stage.optim, device=device, autocast=torch.bfloat16 if device == "cuda" else None)
    objective = build_objective(stage, model=model, temperature=1.0, current_version=0)

    def update():
        if engine is not None:
            refresh_rollout_copy(engine, model, frozen=False)
            engine.refresh_rollout_weights()

    steps, updates = [], []
    for b in data:
        steps.append(timed(lambda: trainer.train_step(b, objective), device))
        updates.append(timed(update, device))
    return {"model": model, "state_bytes": trainer_state_bytes(model, trainer.opt),
            "step_ms": statistics.median(steps[1:] or steps), "update_ms": statistics.median(updates[1:] or updates)}


def merged_check(model, vocab: int) -> tuple[float, float]:
    """(max |LoRA logits - merged plain model's|, max |LoRA logits - base's|) in float32, adapters moved off zero."""
    model = model.float().eval()
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.02, generator=torch.Generator(layer.lora_B.device).manual_seed(1))
        ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(2)).to(next(model.parameters()).device)
        logits = lambda m: (lambda o: o[0] if isinstance(o, tuple) else o)(m(ids)).float()  # noqa: E731
        adapted, plain = logits(model), logits(merged_copy(model))
        with adapters_off(model):
            base = logits(model)
    return float((adapted - plain).abs().max()), float((adapted - base).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU: the SmolLM2 shape cut to 6 layers, 3 steps an arm of 2 rows")
    ap.add_argument("--layers", type=int, default=None, help="the shape's layers cut to this many")
    ap.add_argument("--shape", choices=list(SHAPES), default=None)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="prompt and response tokens of a row (each)")
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.quick else "cpu"
    shape = a.shape or ("smollm2" if a.quick or device == "cpu" else "qwen3")
    rows, tokens = a.rows or (2 if device == "cpu" else 32), a.tokens or (64 if device == "cpu" else 512)
    steps = a.steps or (3 if device == "cpu" else 10)
    a.layers = a.layers or (6 if a.quick else None)
    vocab = SHAPES[shape]["vocab_size"]
    data = batches(vocab, rows, tokens, steps)
    lora = {"rank": a.rank, "alpha": float(a.rank)}
    print(f"{shape}{f' cut to {a.layers} layers' if a.layers else ''} on {device}: {rows} rows x {tokens}+{tokens} tokens, "
          f"{steps} SFT steps an arm, LoRA rank {a.rank} on every linear layer", flush=True)
    res = {}
    for name, cfg in (("full", None), ("lora", lora)):
        res[name] = arm(shape, device, cfg, data, a.layers)
        r = res[name]
        print(f"  {name:>4}: trainer state {r['state_bytes'] / 2**20:,.1f} MiB, step {r['step_ms']:.1f} ms, "
              f"weight update {r['update_ms']:.2f} ms", flush=True)
        if name == "full":
            del r["model"]  # one model at a time in memory
    diff, moved = merged_check(res["lora"].pop("model"), vocab)
    ok = int(diff <= 1e-4 and moved > 100 * 1e-4)
    print(f"  LoRA forward against its merged plain model: max |dlogit| {diff:.2e} (the adapters move it {moved:.2e})")
    ratio = res["full"]["state_bytes"] / res["lora"]["state_bytes"]
    print(f"RESULT lora_equals_merged={ok} lora_merged_max_abs_diff={diff:.3g} full_over_lora_state_bytes={ratio:.3f} "
          f"full_step_ms={res['full']['step_ms']:.1f} lora_step_ms={res['lora']['step_ms']:.1f} "
          f"full_update_ms={res['full']['update_ms']:.2f} lora_update_ms={res['lora']['update_ms']:.2f}")


if __name__ == "__main__":
    main()

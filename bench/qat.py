"""QAT for the FP4 KV cache on the quickstart task (issue #5; seed §2.4.4): does a short QAT fine-tune
recover what storing the KV cache in FP4 costs?

From one trained checkpoint (the quickstart's GRPO output), side by side in one run:
  bf16          the checkpoint, unquantised KV cache (held-out greedy accuracy)
  fp4_noqat     the same weights, the engine storing K/V as packed FP4 (E2M1 + E4M3 per 16 channels)
  fp4_qat       after `--minutes` of GRPO with `model.kv_cache: {dtype: fp4, qat: true}` (the training
                forward passes K/V through the same quantise->dequantise, straight-through gradient)
  bf16_ft       control: the same GRPO fine-tune with the unquantised cache
Goal: fp4_qat within 1 point of bf16 (and of bf16_ft).

    python bench/qat.py --checkpoint runs/quickstart/checkpoints/step-<N>-000 --minutes 3   # the run's last
                                     # stage-end checkpoint, the one `rl eval runs/quickstart` names
    python bench/qat.py --quick        # a briefly trained tiny model, 32 problems, seconds of fine-tune

Last line: RESULT acc_bf16=<x> acc_fp4_noqat=<y> acc_fp4_qat=<z> acc_bf16_ft=<w> ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.pretrained import load_checkpoint, load_weights_into  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from rl.algo.evaluation import engine_generate, evaluate  # noqa: E402
from rl.recipe_io import load_recipe  # noqa: E402
from rl.algo.rendering import Renderer  # noqa: E402


def accuracy(model: Decoder, recipe, max_problems: int) -> float:
    """Greedy held-out accuracy through the evaluation loop of rl/algo/evaluation.py."""
    tok = recipe.tokenizer.build()
    tasks = {d.name: d.build() for d in recipe.datasets[:1]}
    with torch.no_grad():
        return evaluate(engine_generate(model, recipe.engine, tok.eos_id), Renderer(tok, tasks), tasks,
                        max_new_tokens=recipe.engine.max_new_tokens, max_problems=max_problems)["eval/accuracy"]


def with_kv(model: Decoder, dtype: str, qat: bool = False) -> Decoder:
    cfg = model.config.model_copy(update={"kv_cache": model.config.kv_cache.model_copy(update={"dtype": dtype, "qat": qat})})
    out = Decoder(cfg)
    out.load_state_dict(model.state_dict())
    return out


def fine_tune(recipe_path: Path, ckpt: Path, run_dir: Path, kv: str, minutes: float | None, extra: list[str],
              steps: int = 100000) -> Path:
    from rl.algo.driver import train

    overrides = [f"run.init_checkpoint={ckpt}", f"model.kv_cache.dtype={kv}", f"model.kv_cache.qat={kv != 'bf16'}",
                 "runtime.ray=false", "logging.wandb=false", "logging.progress_bar=false",
                 f"stages=[{{type: grpo, max_steps: {steps}, max_minutes: {'null' if minutes is None else minutes}, "
                 "prompts_per_step: 16, group_size: 8, "
                 f"optim: {{lr: 5.0e-5}}, dispatch: {{policy: sample, max_inflight: 128, max_version_lag: 4}}}}]", *extra]
    recipe = load_recipe(recipe_path, overrides)
    train(recipe, run_dir, say=lambda m: print("   ", m, flush=True))
    return last_stage_end(run_dir)


def last_stage_end(run_dir: Path) -> Path:
    """The run's newest stage-end checkpoint (rl/checkpoint/format.py)."""
    from rl.checkpoint.format import CheckpointManager

    path = CheckpointManager(run_dir / "checkpoints").latest(stage_end_only=True)
    if path is None:
        raise SystemExit(f"{run_dir}: no stage-end checkpoint")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", help="trained checkpoint (default with --quick: a tiny model trained here)")
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--minutes", type=float, default=3.0, help="GRPO fine-tune per arm (wall clock)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO fine-tune per arm in steps (overrides --minutes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="fp4,bf16", help="fine-tune arms: fp4 (QAT) and/or bf16 (control)")
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="qat-"))
    extra: list[str] = []
    recipe_path = Path(args.recipe)
    if args.quick:  # a tiny dense model, SFT for a few seconds: enough for non-zero accuracy
        args.problems, args.minutes = 32, 0.1
        extra = ["model.hidden_size=64", "model.num_layers=2", "model.head_dim=16", "model.num_heads=4", "model.num_kv_heads=2",
                 "datasets.0.max_digits=2", "datasets.0.num_heldout=32", "engine.max_new_tokens=24"]
        if args.checkpoint is None:
            from rl.algo.driver import train

            r = load_recipe(recipe_path, [*extra, "runtime.ray=false", "logging.wandb=false", "logging.progress_bar=false",
                                          "stages=[{type: sft, max_steps: 150, batch_size: 32, optim: {lr: 3.0e-3}}]"])
            train(r, work / "base", say=lambda m: None)
            args.checkpoint = str(last_stage_end(work / "base"))
    ckpt = Path(args.checkpoint)
    recipe = load_recipe(recipe_path, [*extra, "runtime.ray=false"])
    problems = args.problems
    base = load_checkpoint(ckpt)
    res = {"acc_bf16": accuracy(with_kv(base, "bf16"), recipe, problems),
           "acc_fp4_noqat": accuracy(with_kv(base, "fp4"), recipe, problems),
           "acc_fp8_noqat": accuracy(with_kv(base, "fp8"), recipe, problems)}
    print(res, flush=True)
    arms = [a for a in (("fp4", "acc_fp4_qat"), ("bf16", "acc_bf16_ft")) if a[0] in args.arms.split(",")]
    for kv, key in arms:
        out = fine_tune(recipe_path, ckpt, work / f"ft_{kv}", kv, None if args.steps else args.minutes,
                        [*extra, f"run.num_threads={args.threads}"], steps=args.steps or 100000)
        model = Decoder(base.config.model_copy(update={"kv_cache": base.config.kv_cache.model_copy(update={"dtype": kv})}))
        load_weights_into(model, out)
        res[key] = accuracy(model, recipe, problems)
        print(key, res[key], flush=True)
    res["qat_gap_points"] = round(100 * (res["acc_bf16"] - res["acc_fp4_qat"]), 2)
    res["problems"] = problems
    res["per_arm"] = f"{args.steps}steps" if args.steps else f"{args.minutes}min"
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print("RESULT " + " ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in res.items()))


if __name__ == "__main__":
    main()

"""GRPO vs more SFT from the same SFT checkpoint, for the same wall-clock minutes (issue #2 evidence).

    python bench/quickstart_control.py [--recipe configs/quickstart.yaml] [--from CKPT] [--minutes 10] [--quick]

Without --from, the recipe's SFT stage runs first and its checkpoint is the common start. Then two
branches run one after the other on the same machine, each for --minutes: (a) the recipe's GRPO stage,
(b) the recipe's SFT stage continued on the same (slipped) demonstrations. Both are evaluated greedily
on the same held-out problems. Last line: RESULT sft_acc=.. grpo_acc=.. control_sft_acc=.. minutes=..
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rl.checkpoint import CheckpointManager
from rl.config import Recipe
from rl.driver import train
from rl.recipe_io import load_recipe


def _variant(recipe: Recipe, *, stage_type: str, minutes: float | None, init: Path | None, name: str) -> Recipe:
    data = recipe.model_dump(mode="json")
    stage = next(s for s in data["stages"] if s["type"] == stage_type)
    if minutes is not None:
        stage["max_minutes"], stage["max_steps"] = minutes, 10**6
    data["stages"] = [stage]
    data["run"]["name"] = name
    data["run"]["init_checkpoint"] = None if init is None else str(init)
    data["logging"]["progress_bar"] = False
    return Recipe.model_validate(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="configs/quickstart.yaml")
    ap.add_argument("--from", dest="init", type=Path, help="SFT stage-end checkpoint to branch from (RUN/checkpoints/step-*)")
    ap.add_argument("--minutes", type=float, default=10.0, help="budget of each branch")
    ap.add_argument("--out", type=Path, help="where to write runs and the JSON summary (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny budgets: finishes in under a minute")
    args = ap.parse_args()
    overrides = ["datasets.0.num_heldout=64"] if args.quick else []
    recipe = load_recipe(args.recipe, overrides)
    minutes = 0.15 if args.quick else args.minutes
    out = args.out or Path(tempfile.mkdtemp(prefix="qs_control_"))
    t0 = time.monotonic()
    init = args.init
    if init is None:
        sft_minutes = 0.2 if args.quick else None
        train(_variant(recipe, stage_type="sft", minutes=sft_minutes, init=None, name="sft"), out / "sft")
        init = CheckpointManager(out / "sft" / "checkpoints").latest(stage_end_only=True)
    marker = CheckpointManager.stage_end(init)  # a stage-end checkpoint carries its held-out evaluation
    if marker is None:
        raise SystemExit(f"{init} is not a stage-end checkpoint (rl/checkpoint.py): its SFT accuracy is unknown")
    sft_acc = marker["eval"]["eval/accuracy"]
    grpo = train(_variant(recipe, stage_type="grpo", minutes=minutes, init=init, name="grpo"), out / "grpo")
    ctrl = train(_variant(recipe, stage_type="sft", minutes=minutes, init=init, name="control"), out / "control")
    summary = {"sft_acc": round(sft_acc, 4), "grpo_acc": grpo["grpo_acc"], "control_sft_acc": ctrl["sft_acc"],
               "minutes": minutes, "total_minutes": round((time.monotonic() - t0) / 60, 2)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{'branch':<28}{'held-out accuracy':>18}")
    print(f"{'SFT checkpoint (start)':<28}{summary['sft_acc']:>18.3f}")
    print(f"{f'+ GRPO {minutes} min':<28}{summary['grpo_acc']:>18.3f}")
    print(f"{f'+ SFT {minutes} min (control)':<28}{summary['control_sft_acc']:>18.3f}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()

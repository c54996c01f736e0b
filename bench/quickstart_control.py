"""GRPO vs more SFT from the same SFT checkpoint, for the same wall-clock minutes (issue #2 evidence).

    python bench/quickstart_control.py [--recipe configs/quickstart.yaml] [--from CKPT] [--minutes 10] [--quick]
        [--grpo-variant dynamic_sampling=true ...] [--no-control]

Without --from, the recipe's SFT stage runs first and its checkpoint is the common start. Then two
branches run one after the other on the same machine, each for --minutes: (a) the recipe's GRPO stage,
(b) the recipe's SFT stage continued on the same (slipped) demonstrations. Both are evaluated greedily
on the same held-out problems. `--grpo-variant FIELD=VALUE` (repeatable) adds a third branch: the GRPO stage with
those fields changed (e.g. dynamic_sampling=true), after the plain one; `--no-control` leaves the SFT control out.
Last line: RESULT sft_acc=.. grpo_acc=.. grpo_steps=.. [variant_acc=.. variant_steps=..] [control_sft_acc=..] minutes=..
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

from rl.checkpoint.format import CheckpointManager
from rl.config import Recipe
from rl.algo.driver import train
from rl.recipe_io import load_recipe


def _variant(recipe: Recipe, *, stage_type: str, minutes: float | None, init: Path | None, name: str,
             fields: dict | None = None) -> Recipe:
    data = recipe.model_dump(mode="json")
    stage = next(s for s in data["stages"] if s["type"] == stage_type)
    stage.update(fields or {})
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
    ap.add_argument("--grpo-variant", action="append", default=[], metavar="FIELD=VALUE", type=_field_value,
                    help="a second GRPO branch with this stage field changed (repeatable; VALUE is YAML)")
    ap.add_argument("--no-control", action="store_true", help="leave the SFT control branch out")
    args = ap.parse_args()
    variant = dict(args.grpo_variant)
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
        raise SystemExit(f"{init} is not a stage-end checkpoint (rl/checkpoint/format.py): its SFT accuracy is unknown")
    sft_acc = marker["eval"]["eval/accuracy"]
    grpo = train(_variant(recipe, stage_type="grpo", minutes=minutes, init=init, name="grpo"), out / "grpo")
    summary = {"sft_acc": round(sft_acc, 4), "grpo_acc": grpo["grpo_acc"], "grpo_steps": _steps(out / "grpo")}
    rows = [("SFT checkpoint (start)", sft_acc, ""), (f"+ GRPO {minutes} min", grpo["grpo_acc"], summary["grpo_steps"])]
    if variant:
        var = train(_variant(recipe, stage_type="grpo", minutes=minutes, init=init, name="variant", fields=variant),
                    out / "variant")
        summary.update(variant_acc=var["grpo_acc"], variant_steps=_steps(out / "variant"))
        rows.append((f"+ GRPO {minutes} min, {', '.join(f'{k}={v}' for k, v in variant.items())}", var["grpo_acc"],
                     summary["variant_steps"]))
    if not args.no_control:
        ctrl = train(_variant(recipe, stage_type="sft", minutes=minutes, init=init, name="control"), out / "control")
        summary["control_sft_acc"] = ctrl["sft_acc"]
        rows.append((f"+ SFT {minutes} min (control)", ctrl["sft_acc"], ""))
    summary.update(minutes=minutes, total_minutes=round((time.monotonic() - t0) / 60, 2))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{'branch':<48}{'held-out accuracy':>18}{'steps':>8}")
    for name, acc, steps in rows:
        print(f"{name:<48}{acc:>18.3f}{steps:>8}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in summary.items()))


def _field_value(text: str) -> tuple[str, object]:
    """--grpo-variant FIELD=VALUE, the value read as YAML (true, 2e-5, ...)."""
    field, eq, value = text.partition("=")
    if not field or not eq:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return field, yaml.safe_load(value)


def _steps(run_dir: Path) -> int:
    """Train steps the branch took (its metrics lines with a loss)."""
    return sum('"rl/loss"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())


if __name__ == "__main__":
    main()

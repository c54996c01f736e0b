"""`rl export RUN_DIR [--step N | --checkpoint DIR] [--adapter] --out DIR`: a run's checkpoint as a Hugging Face
directory (config.json, safetensors, generation_config.json, tokenizer files) that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as is (model/pretrained.py `export_checkpoint`; a LoRA
run's merged weights), or with `--adapter` a LoRA run's adapters as a PEFT adapter directory that
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the run's base (`export_peft_adapter`).

The checkpoint is the run's newest that verifies (rl/checkpoint/format.py `CheckpointManager.latest`, the one
finder), or the newest of global step N. Tokenizer files come from the run's `model.init` when it is a
Hugging Face directory. Bad input (not a run directory, no such checkpoint, an output directory in the
way, a model with no Hugging Face architecture) prints one line and exits 2.

The export itself is rl/checkpoint/export.py's `export_run_checkpoint`, which the job also runs at the end of
a stage (runs started from a pretrained model: `stage_end_export`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from configbase.files import WriteRefused, output_dir

EXIT_BAD_INPUT = 2


def add_export_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory")
    p.add_argument("run_dir")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="the checkpoint of this global step (default: the newest)")
    which.add_argument("--checkpoint", default=None, help="this checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) for the base it was trained on, not the merged model")
    p.set_defaults(func=cmd_export)


def _fail(msg: str) -> int:
    print(f"rl export: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_export(args: argparse.Namespace) -> int:
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not (run_dir / "recipe.yaml").is_file():
        return _fail(f"{run_dir} is not a run directory (no recipe.yaml)")
    try:  # absent or an empty directory, not a link, not `.` (configbase/files.py): nothing of the user's replaced
        out = output_dir(out)
    except WriteRefused as e:
        return _fail(str(e))
    from rl.checkpoint.export import export_run_checkpoint
    from rl.checkpoint.format import find_checkpoint
    from rl.recipe_io import RecipeError, load_recipe

    try:
        recipe = load_recipe(run_dir / "recipe.yaml")
        ckpt = Path(args.checkpoint) if args.checkpoint else find_checkpoint(run_dir, args.step, warn=lambda m: print(m, file=sys.stderr))
        if not (ckpt / "model.safetensors").is_file() or not (ckpt / "config.json").is_file():
            raise ValueError(f"{ckpt} is not a checkpoint (no model.safetensors and config.json)")
        if args.adapter:
            from model.pretrained import export_peft_adapter
            from model.registry import resolve_model_source

            base = None if recipe.model.init is None else str(resolve_model_source(recipe.model.init))
            export_peft_adapter(ckpt, out, base_model=base)
        else:
            export_run_checkpoint(recipe, ckpt, out)
    except (ValueError, RecipeError) as e:  # CheckpointFormatError and WriteRefused are ValueErrors
        return _fail(str(e).splitlines()[0])
    print(f"exported {ckpt} -> {args.out}")
    return 0

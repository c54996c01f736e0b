"""`rl` command line: validate and train recipes, inspect trajectories.

    rl validate RECIPE [--set a.b=c ...]
    rl train RECIPE [--run-dir DIR] [--resume RUN_DIR] [--set a.b=c ...]
    rl resume RUN_DIR [--set a.b=c ...]       continue a preempted or killed run from its checkpoint
    rl traj ls RUN_DIR [filters]      rl traj show RUN_DIR SAMPLE_ID
    rl eval RUN_DIR [--effort 10,25,50,75,90,100]

A bad recipe prints one line naming the field (and YAML line) and exits 2. torch is imported only by
commands that need it, so `rl validate` is instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl.recipe_io import RecipeError, load_recipe
from rl.eval_cli import add_eval_parser
from rl.traj_cli import add_traj_parser

EXIT_BAD_INPUT = 2


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set stages.1.optim.lr=3e-5 (repeatable)")


def cmd_validate(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    stages = " -> ".join(s.type for s in recipe.stages)
    print(f"ok: {args.recipe} ({len(recipe.stages)} stages: {stages}; datasets: {', '.join(d.name for d in recipe.datasets)})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    if args.resume and args.run_dir and Path(args.resume) != Path(args.run_dir):
        raise RecipeError("--resume", "give either --run-dir or --resume RUN_DIR, not two different directories")
    run_dir = Path(args.resume or args.run_dir or Path("runs") / recipe.run.name)
    return _train(recipe, run_dir, resume=bool(args.resume))


def cmd_resume(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "recipe.yaml").is_file():
        raise RecipeError(str(run_dir), "not a run directory (no recipe.yaml)")
    return _train(load_recipe(run_dir / "recipe.yaml", args.overrides), run_dir, resume=True)


def _train(recipe, run_dir: Path, resume: bool) -> int:
    from rl.checkpoint import CheckpointError
    from rl.driver import train  # heavy: torch

    try:
        summary = train(recipe, run_dir, resume=resume)
    except CheckpointError as e:
        print(f"rl: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("RESULT " + " ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl", description="asyncrl: asynchronous RL and OPD post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a recipe and exit")
    _add_recipe_args(p)
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("train", help="run a recipe")
    _add_recipe_args(p)
    p.add_argument("--run-dir", help="run directory (default runs/<run.name>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its newest valid checkpoint")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("resume", help="continue a run from its newest valid checkpoint (its own recipe)")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (compatible changes only: budgets, logging, lr, ...)")
    p.set_defaults(func=cmd_resume)
    add_traj_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RecipeError as e:
        print(f"rl: recipe error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())

"""`rl` command line: validate and train recipes, inspect trajectories.

    rl validate RECIPE [--set a.b=c ...]
    rl train RECIPE [--run-dir DIR] [--resume RUN_DIR] [--set a.b=c ...]
    rl resume RUN_DIR [--set a.b=c ...] [--new-identity]   continue a preempted or killed run from its checkpoint
    rl reconfigure RUN_DIR [PATCH.yaml] [--set mixture.arith=2 ...]   change a running job live
    rl traj ls RUN_DIR [filters]      rl traj show RUN_DIR SAMPLE_ID
    rl eval RUN_DIR [--effort 10,25,50,75,90,100]
    rl merge RUN_A[:STEP] RUN_B ... [--weights 0.5 0.5] --out DIR   weighted average of checkpoints
    rl db upgrade RUN_DIR | DB_FILE | URL     bring a trajectory store to this code's schema
    rl models fetch NAME [--dir DIR]          download and verify a known pretrained model file (rl models ls)
    rl export RUN_DIR [--step N] --out DIR    a checkpoint as a Hugging Face model directory

A bad recipe prints one line naming the field (and YAML line) and exits 2. torch is imported only by
commands that need it, so `rl validate` is instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from configbase import finite_float
from rl.recipe_io import RecipeError, load_recipe
from rl.cli.db import add_db_parser
from rl.cli.eval import add_eval_parser
from rl.cli.merge import add_merge_parser
from rl.cli.models import add_models_parser
from rl.cli.export import add_export_parser
from rl.cli.traj import add_traj_parser
from rl.ui.plot import add_plot_parser
from rl.ui.server import add_ui_parser

EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 3
EXIT_WORKER_FAILED = 4
EXIT_DIVERGED = 5
"""Exit codes (README "Exit codes"): 0 done, 1 internal error (a traceback), 2 bad input or refused (one line),
3 preempted by SIGTERM/SIGINT with a checkpoint written: `rl resume` continues it (a scheduler requeues on 3),
4 a worker died or hung: `rl resume` continues from the newest checkpoint (requeue too), 5 the training diverged (a
non-finite loss or gradient norm at step N, not applied): the newest checkpoint is the last good one; fix the recipe
(a lower lr), then `rl resume RUN_DIR --set ...` (do not requeue as is: it would diverge again)."""
EXIT_INTERRUPTED = 130
"""SIGINT (Ctrl-C) while a command starts, before a job installs its own handler (whose first SIGINT writes a
checkpoint and exits 3, its second exits 130 at once): 128 + SIGINT, as a shell reports it; nothing new to resume."""
INTERRUPTED = "interrupted (SIGINT)"


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set stages.1.optim.lr=3e-5 (repeatable)")


def cmd_validate(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    from rewards.procedural import ProceduralTask
    from rl.algo.prompt_lengths import check_prompt_lengths  # the first rows of files; the job checks every row
    from rl.algo.rendering import Renderer
    from rl.runtime.memory import check  # torch (a meta-device model): after the recipe itself checked out

    try:
        tasks = {d.name: d.build() for d in recipe.datasets}
        for task in tasks.values():
            if isinstance(task, ProceduralTask):  # its held-out set, drawn in milliseconds (files: the job scans them)
                task.scan()
        renderer = Renderer.for_recipe(recipe, tasks)
        check_prompt_lengths(renderer, tasks, recipe.engine.overlong_prompts, recipe.effort.levels if recipe.effort else (),
                             preview=True)
        memory = check(recipe)
    except ValueError as e:
        print(f"rl validate: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stages = " -> ".join(s.type for s in recipe.stages)
    print(f"ok: {args.recipe} ({len(recipe.stages)} stages: {stages}; datasets: {', '.join(d.name for d in recipe.datasets)})")
    print(memory)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    if args.resume and args.run_dir and Path(args.resume) != Path(args.run_dir):
        raise RecipeError("--resume", "give either --run-dir or --resume RUN_DIR, not two different directories")
    run_dir = Path(args.resume or args.run_dir or Path("runs") / recipe.run.name)
    if args.resume and args.overwrite:
        raise RecipeError("--overwrite", "--resume continues a run; --overwrite starts one over: give one of them")
    return _train(recipe, run_dir, "rl train", resume=bool(args.resume), overwrite=args.overwrite, break_lock=args.break_lock)


def cmd_resume(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "recipe.yaml").is_file():
        raise RecipeError(str(run_dir), "not a run directory (no recipe.yaml)")
    return _train(load_recipe(run_dir / "recipe.yaml", args.overrides), run_dir, "rl resume", resume=True,
                  break_lock=args.break_lock, new_identity=args.new_identity)


def _train(recipe, run_dir: Path, prefix: str, resume: bool, overwrite: bool = False, break_lock: bool = False,
           new_identity: bool = False) -> int:
    from model.chat_template import ChatTemplateError
    from model.formats import CheckpointFormatError
    from model.kv_cache import KVFormatDeviceError
    from rewards.dataset_io import DatasetError
    from rewards.verifiers import RewardFunctionFailed
    from rl.checkpoint.format import CheckpointError
    from rl.algo.driver import Diverged, train  # heavy: torch
    from rl.checkpoint.run_dir import RunDirError
    from rl.runtime.placement import PlacementError
    from rl.runtime.groups import WorkerFailure
    from rl.runtime.sandbox_nodes import SandboxStartError
    from rl.store.db import StoreError
    from teachers.pool import TeacherPoolError
    from rollout.engine import KVPoolSizeError
    from configbase.files import WriteRefused

    try:
        summary = train(recipe, run_dir, resume=resume, overwrite=overwrite, break_lock=break_lock,
                        new_identity=new_identity)
    except (CheckpointError, CheckpointFormatError, ChatTemplateError, StoreError, DatasetError, RunDirError,
            SandboxStartError, PlacementError, KVPoolSizeError, KVFormatDeviceError, TeacherPoolError, WriteRefused) as e:
        print(f"{prefix}: {str(e).strip().splitlines()[-1]}", file=sys.stderr)  # a worker's: its own last line
        return EXIT_BAD_INPUT
    except WorkerFailure as e:
        print(f"{prefix}: {e}" + ("" if e.at_start else f"; the newest checkpoint holds: rl resume {run_dir}"), file=sys.stderr)
        return EXIT_BAD_INPUT if e.at_start else EXIT_WORKER_FAILED
    except Diverged as e:
        print(f"{prefix}: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except RewardFunctionFailed as e:  # a `python:` verifier that keeps failing; from a Ray actor, its `cause`
        print(f"{prefix}: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("RESULT " + " ".join(f"{k}={v}" for k, v in summary.items()))
    return EXIT_PREEMPTED if summary.get("preempted") else 0


def cmd_reconfigure(args: argparse.Namespace) -> int:
    """Validate a patch against the run's recipe, hand it to the running job, print its answer."""
    from rl import reconfigure as rc
    from rl.config import OPDStage

    run_dir = Path(args.run_dir)
    if not (run_dir / "recipe.yaml").is_file():
        raise RecipeError(str(run_dir), "not a run directory (no recipe.yaml)")
    text = ""
    if args.patch:
        try:
            text = Path(args.patch).read_text()
        except OSError as e:
            raise RecipeError(args.patch, f"cannot read the patch ({e.strerror})") from None
    try:
        patch = rc.parse_patch(text, source=args.patch or "--set", overrides=args.overrides)
        recipe = load_recipe(run_dir / "recipe.yaml")
        teachers = {t.name: t for st in recipe.stages if isinstance(st, OPDStage) for t in st.teachers.teachers}
        known = rc.LiveConfig(0, {}, {}, {}, teachers)
        rl_datasets = recipe.datasets_of_rl_stages()  # the running stage's loop checks its own
        rc.check_patch(known, patch, rl_datasets, recipe.model.vocab_size)
    except rc.ReconfigError as e:
        print(f"rl reconfigure: bad patch: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from rl.checkpoint.run_dir import running_job

    if running_job(run_dir) is None:  # a patch left in the inbox would be applied by some later job
        print(f"rl reconfigure: no job is running in {run_dir} (its lock is free): a patch changes a running job only; "
              "nothing was queued", file=sys.stderr)
        return EXIT_BAD_INPUT
    pid = rc.submit(run_dir, patch)
    answer = rc.wait_answer(run_dir, pid, args.wait, alive=lambda: running_job(run_dir) is not None)
    if answer is None and running_job(run_dir) is None:  # the job ended without answering: nothing may linger
        print("rl reconfigure: the job stopped before answering; " + (
            "the patch was withdrawn, nothing changed" if rc.withdraw(run_dir, pid) else
            "it was validating the patch, which a resume refuses"), file=sys.stderr)
        return EXIT_BAD_INPUT
    if answer is None:
        print(f"queued: patch {pid} waits in {rc.inbox(run_dir)}; the job applies it at its next token boundary "
              f"(no answer within {args.wait:g} s: is the job running, or in an SFT stage?)")
        return 0
    if answer["status"] != "applied":  # the job validated it (rl/reconfigure.py) and runs on unchanged
        print(f"rl reconfigure: the job refused the patch: {answer['reason']}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"applied: config version {answer['version']} at train step {answer['train_step']}: {answer['patch']}")
    return 0


def cmd_sandbox(args: argparse.Namespace) -> int:
    from sandbox_client.cli import serve

    return serve(args.args, prog=f"rl sandbox {args.action}")


def _add_break_lock(p: argparse.ArgumentParser) -> None:
    p.add_argument("--break-lock", action="store_true",
                   help="do not take the run directory's lock (filesystems without working file locks only)")


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`rl eval: argument --max-problems: must be at least 1`)
    and exit 2, like every other expected failure of the CLI; `-h` still prints the usage."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message.splitlines()[0]}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="rl", description="asyncrl: asynchronous RL and OPD post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a recipe and exit")
    _add_recipe_args(p)
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("train", help="run a recipe")
    _add_recipe_args(p)
    p.add_argument("--run-dir", help="run directory (default runs/<run.name>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its newest valid checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds a run (its checkpoints, metrics and store go)")
    _add_break_lock(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("resume", help="continue a run from its newest valid checkpoint (its own recipe)")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (compatible changes only: budgets, logging, lr, ...)")
    p.add_argument("--new-identity", action="store_true",
                   help="resume this run directory as a new run in its store (a copy of a run: its rows up to the "
                        "checkpoint are copied under a new run id; the original's stay its own)")
    _add_break_lock(p)
    p.set_defaults(func=cmd_resume)
    p = sub.add_parser("reconfigure", help="change a running job's dataset mixture, caps or teachers")
    p.add_argument("run_dir", help="run directory of the running job")
    p.add_argument("patch", nargs="?", help="YAML patch: mixture, dataset_max_inflight, teachers, add_teachers")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="patch field, e.g. --set mixture.reverse=3 --set teachers.reverse=t07 (repeatable)")
    p.add_argument("--wait", type=finite_float, default=60.0, help="seconds to wait for the job's answer")
    p.set_defaults(func=cmd_reconfigure)
    p = sub.add_parser("sandbox", help="run the sandbox server of this node (sandbox_client/)", add_help=False)
    p.add_argument("action", choices=["serve"], help="serve: run a sandbox server until SIGTERM/SIGINT")
    p.add_argument("args", nargs=argparse.REMAINDER, help="--socket PATH [--max-sandboxes N] [--backend bwrap|process]")
    p.set_defaults(func=cmd_sandbox)
    add_traj_parser(sub)
    add_ui_parser(sub)
    add_plot_parser(sub)
    add_eval_parser(sub)
    add_db_parser(sub)
    add_merge_parser(sub)
    add_models_parser(sub)
    add_export_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RecipeError as e:
        print(f"rl {args.command}: recipe error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BaseException as e:  # SIGINT before a job's own handler (rl/checkpoint/preempt.py) took it over
        if not _interrupted(e):
            raise
        print(f"rl {args.command}: {INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _interrupted(e: BaseException | None) -> bool:
    """A KeyboardInterrupt, or an error raised while unwinding from one (cleanup code that meets a module whose import
    the interrupt cut short, e.g. numpy's): either way the user's Ctrl-C, and one line."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, KeyboardInterrupt):
            return True
        e, seen = e.__context__, seen + 1
    return False


if __name__ == "__main__":
    raise SystemExit(main())

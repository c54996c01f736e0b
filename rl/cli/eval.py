"""`rl eval RUN_DIR [--effort 10,25,50,75,90,100] [--checkpoint DIR] [--set KEY=VALUE]`: held-out accuracy and mean
response length of a run's latest checkpoint, per reasoning-effort level (levels never trained on
included), in-process, through the same evaluation loop and sampler seeds as the run's own evaluation
(rl/algo/evaluation.py), so both agree at any temperature."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

from configbase.files import WriteRefused, atomic_open, check_replaceable

EXIT_BAD_INPUT = 2


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="held-out accuracy and length of a run's checkpoint, per effort level")
    p.add_argument("run_dir")
    p.add_argument("--effort", default=None, help="comma-separated effort levels in 1..100 (default: no effort prefix)")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the run's latest)")
    p.add_argument("--max-problems", type=_positive_int, default=None,
                   help="held-out problems per dataset (default: the recipe's)")
    p.add_argument("--responses", type=Path, default=None, metavar="FILE",
                   help="also write every evaluated problem's response and verdict here, one JSON object per line")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the run's recipe for this evaluation, e.g. "
                        "datasets.0.heldout.path=train.jsonl (score the training problems)")
    p.set_defaults(func=cmd_eval)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fail(msg: str) -> int:
    print(f"rl eval: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _write_jsonl(path: Path, records: list[dict]) -> None:
    """Whole lines only: written to a fresh temporary file, then renamed over `path` (its folder exists: cmd_eval),
    which must be absent or a regular file (configbase/files.py `atomic_open`; `WriteRefused` otherwise)."""
    import json

    with atomic_open(path) as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def _load_model(ckpt: Path, vocab_size: int, device: str):
    """The checkpoint's model, in eval mode; `ValueError` (one line naming the checkpoint) when its files do not load
    or its vocabulary is not the run's (`--checkpoint` names any directory: its token ids would mean other text)."""
    from safetensors import SafetensorError

    from model.checkpoint import load_config
    from model.pretrained import load_checkpoint

    try:
        config = load_config(ckpt)
    except (OSError, ValueError) as e:  # ValueError: pydantic's, for JSON that is not a model config
        raise ValueError(f"checkpoint {ckpt}: config.json is not a readable model config "
                         f"({' '.join(str(e).split())[:200]})") from None
    if config.vocab_size != vocab_size:
        raise ValueError(f"checkpoint {ckpt} has a vocabulary of {config.vocab_size} ids, the run's model has {vocab_size} "
                         f"(model.vocab_size): it was trained with another tokenizer")
    try:
        return load_checkpoint(ckpt, device).eval()
    except (OSError, ValueError, SafetensorError) as e:
        raise ValueError(f"checkpoint {ckpt}: model.safetensors does not load "
                         f"({' '.join(str(e).split())[:200]})") from None


def parse_efforts(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--effort must be comma-separated integers, got {text!r}") from None
    bad = [b for b in levels if not 1 <= b <= 100]
    if not levels or bad:
        raise ValueError(f"--effort levels must be in 1..100, got {text!r}")
    return levels


def cmd_eval(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "recipe.yaml").is_file():
        return _fail(f"{run_dir} is not a run directory (no recipe.yaml)")
    try:
        efforts = parse_efforts(args.effort)
    except ValueError as e:
        return _fail(str(e))
    if args.responses is not None:  # before any work: a path that cannot be written is said at once
        try:
            args.responses.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return _fail(f"--responses {args.responses}: {e.strerror or e}")
        if not os.access(args.responses.parent, os.W_OK) or args.responses.is_dir():
            return _fail(f"--responses {args.responses}: not a writable file path")
        try:  # a link, a FIFO or a folder at the name is never written through or over
            check_replaceable(args.responses)
        except WriteRefused as e:
            return _fail(f"--responses: {e}")
    from rl.checkpoint.format import CheckpointError, CheckpointManager

    try:  # the run's newest checkpoint that verifies (rl/checkpoint/format.py: the one finder)
        ckpt = Path(args.checkpoint) if args.checkpoint else CheckpointManager(
            run_dir / "checkpoints", warn=lambda m: print(m, file=sys.stderr)).latest()
    except CheckpointError as e:
        return _fail(str(e))
    if ckpt is None or not (ckpt / "model.safetensors").is_file():
        return _fail(f"no checkpoint with model.safetensors under {run_dir / 'checkpoints'}")
    from rl.recipe_io import RecipeError, load_recipe

    try:
        recipe = load_recipe(run_dir / "recipe.yaml", args.set)
    except RecipeError as e:
        return _fail(str(e))
    import torch  # heavy imports only past input checks

    from rewards.dataset_io import DatasetError
    from rl.algo.evaluation import engine_generate, evaluate
    from rl.algo.rendering import Renderer

    torch.set_num_threads(recipe.run.num_threads)
    tok = recipe.tokenizer.build()
    tasks = {d.name: d.build() for d in recipe.datasets if d.name in recipe.eval_datasets()}
    try:  # dataset files are read again (they may have changed since training): a bad row is one line
        for task in tasks.values():
            if callable(getattr(task, "scan", None)):
                takes = "need_train" in inspect.signature(task.scan).parameters
                task.scan(**({"need_train": False} if takes else {}))
    except DatasetError as e:
        return _fail(str(e))
    from rl.runtime.tool_turns import ToolTurns

    renderer = Renderer.for_recipe(recipe, tasks, tok)
    device = recipe.run.device if recipe.run.device != "cuda" or torch.cuda.is_available() else "cpu"
    try:
        model = _load_model(ckpt, recipe.model.vocab_size, device)
    except ValueError as e:
        return _fail(str(e))
    tools = ToolTurns.from_recipe(recipe, tok)
    servers = None
    if tools is not None and recipe.sandbox_server == "auto":  # this evaluation's own server (rl/runtime/sandbox_nodes.py)
        from rl.runtime.sandbox_nodes import NodeSandboxes, SandboxStartError, run_key

        # one server (and state directory) per evaluation process: evaluations of one run side by side (the
        # pipeline bench scores several models against one run's recipe at once) must not share one
        servers = NodeSandboxes(f"{run_key(run_dir)}#eval-{os.getpid()}", recipe.sandbox.backend,
                                recipe.sandbox_slots(), remote=False, say=lambda _: None,
                                warm_interpreter=recipe.sandbox.warm_interpreter)
        try:
            tools.use_server(servers.start([""], driver_node="")[""])
        except SandboxStartError as e:
            servers.stop()
            return _fail(str(e))
    try:
        generate = engine_generate(model, recipe.engine, tok.eos_id, tok.eos_ids, tools=tools)
        records: list[dict] | None = [] if args.responses is not None else None
        print(f"checkpoint {ckpt}")
        print(f"{'effort':>7} {'dataset':<10} {'accuracy':>9} {'resp_len':>9} {'reasoning':>10} {'problems':>9}")
        for b in efforts:
            m = evaluate(generate, renderer, tasks, max_new_tokens=recipe.max_response_tokens, temperature=recipe.eval.temperature,
                         max_problems=args.max_problems or recipe.eval.max_problems, effort=b, records=records)
            for name in tasks:
                e = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith(f"eval/{name}/")}
                label = "-" if b is None else str(b)
                print(f"{label:>7} {name:<10} {e['accuracy']:>9.3f} {e['response_len']:>9.1f} "
                      f"{e['reasoning_tokens']:>10.1f} {int(e['num_problems']):>9}")
        if records is not None:
            try:
                _write_jsonl(args.responses, records)
            except WriteRefused as e:  # planted while the evaluation ran
                return _fail(f"--responses: {e}")
            except OSError as e:
                return _fail(f"--responses {args.responses}: {e.strerror or e}")
            print(f"responses: {len(records)} written to {args.responses}")
    finally:
        if tools is not None:
            tools.shutdown()
        if servers is not None:
            servers.stop()
    return 0

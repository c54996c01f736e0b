"""`rl merge SRC[:STEP] SRC ... [--weights W W ...] --out DIR`: a weighted average of checkpoints of one
architecture, to re-initialise the next run from (seed §5.1.2: checkpoints of runs with different
scaffolds or configurations are merged, then RL continues from the merge).

A source is a run directory (its newest valid checkpoint, or the one of global step STEP) or a model
directory (config.json + model.safetensors, e.g. a stage-end checkpoint or an earlier merge). The weights
are normalised to sum to 1 (said so when they did not); the sources must share the architecture and the
vocabulary (the KV-cache format may differ: it changes storage, not parameters). The output is a model
directory that `run.init_checkpoint` accepts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


class MergeError(ValueError):
    """A merge that cannot be done; the message is one line."""


def add_merge_parser(subparsers) -> None:
    p = subparsers.add_parser("merge", help="weighted average of same-architecture checkpoints (a new init)")
    p.add_argument("sources", nargs="+", help="RUN_DIR, RUN_DIR:STEP or a model directory")
    p.add_argument("--weights", type=float, nargs="+", help="one weight per source (default: equal); normalised to sum 1")
    p.add_argument("--out", required=True, help="output model directory")
    p.set_defaults(func=cmd_merge)


def resolve_source(spec: str) -> Path:
    """The model directory a source names (see the module docstring)."""
    from rl.checkpoint.run_specs import resolve_run_checkpoint, split_run_spec

    p = Path(spec)
    if split_run_spec(spec) is None:
        if (p / "model.safetensors").is_file() and (p / "config.json").is_file():
            return p
        raise MergeError(f"{spec}: neither a model directory (config.json + model.safetensors) nor a run directory")
    try:
        return resolve_run_checkpoint(spec, warn=lambda _m: None)
    except ValueError as e:
        raise MergeError(f"{spec}: {e}") from None


def normalised(weights: list[float] | None, n: int) -> tuple[list[float], bool]:
    """Weights summing to 1 (equal by default) and whether they had to be rescaled."""
    if weights is None:
        return [1.0 / n] * n, False
    if len(weights) != n:
        raise MergeError(f"--weights gives {len(weights)} weights for {n} sources")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise MergeError(f"--weights must be >= 0 and not all 0, got {weights}")
    total = sum(weights)
    return [w / total for w in weights], abs(total - 1.0) > 1e-12


def merge(sources: list[Path], weights: list[float]):
    """The merged Decoder: each parameter and buffer Σ_i w_i θ_i in float64, cast back to its dtype."""
    import torch
    from safetensors.torch import load_file

    from model.checkpoint import load_checkpoint, load_config
    from model.config import same_weights

    configs = [load_config(s) for s in sources]
    for s, c in zip(sources[1:], configs[1:]):
        if c.vocab_size != configs[0].vocab_size:
            raise MergeError(f"{s} has vocab_size={c.vocab_size} but {sources[0]} has {configs[0].vocab_size}: "
                             "merged checkpoints share one vocabulary")
        if not same_weights(c, configs[0]):
            diff = [k for k in type(c).model_fields if getattr(c, k) != getattr(configs[0], k) and k != "kv_cache"]
            raise MergeError(f"{s} has another architecture than {sources[0]} (differs in: {', '.join(diff)})")
    model = load_checkpoint(sources[0])
    states = [load_file(str(s / "model.safetensors")) for s in sources]
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name not in states[0]:  # a tied head is stored once, as the embedding
                continue
            acc = sum(w * st[name].double() for w, st in zip(weights, states))
            t.copy_(acc.to(t.dtype))
    return model


def cmd_merge(args: argparse.Namespace) -> int:
    try:
        sources = [resolve_source(s) for s in args.sources]
        weights, rescaled = normalised(args.weights, len(sources))
        model = merge(sources, weights)
    except MergeError as e:
        print(f"rl merge: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from model.checkpoint import save_checkpoint

    if rescaled:
        print("weights normalised to sum 1: " + ", ".join(f"{w:.4g}" for w in weights))
    out = save_checkpoint(model, args.out, extra={"merged_from": [str(s) for s in sources], "weights": weights})
    print(f"merged {len(sources)} checkpoints into {out}")
    return 0

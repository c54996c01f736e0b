"""`rl merge SRC[:STEP] SRC ... [--weights W W ...] --out DIR`: a weighted average of checkpoints of one
architecture, to re-initialise the next run from (seed §5.1.2: checkpoints of runs with different
scaffolds or configurations are merged, then RL continues from the merge).

A source is a run directory (its newest valid checkpoint, or the one of global step STEP), a model
directory (config.json + model.safetensors, e.g. a stage-end checkpoint or an earlier merge), a Hugging Face
directory (what `rl export` writes, read through the declared conversion) or a GGUF file. The weights
are normalised to sum to 1 (said so when they did not); the sources must share the architecture and the
vocabulary (the KV-cache format may differ: it changes storage, not parameters). The output is a model
directory that `run.init_checkpoint` accepts.

Nothing is destroyed and nothing meaningless is written: `--out` must be absent or an empty directory (a run
directory, even a source of the merge, or an earlier merge is refused in one line before any work;
configbase/files.py), every weight must be a finite number with a positive, finite sum (`1e308 1e308` would
overflow to an all-zero model), every source tensor must be finite, and a damaged source is one line naming
it, exit 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from configbase import finite_float
from configbase.files import WriteRefused, output_dir

EXIT_BAD_INPUT = 2


class MergeError(ValueError):
    """A merge that cannot be done; the message is one line."""


def add_merge_parser(subparsers) -> None:
    p = subparsers.add_parser("merge", help="weighted average of same-architecture checkpoints (a new init)")
    p.add_argument("sources", nargs="+", help="RUN_DIR, RUN_DIR:STEP or a model directory")
    p.add_argument("--weights", type=finite_float, nargs="+", help="one weight per source (default: equal); normalised to sum 1")
    p.add_argument("--out", required=True, help="output model directory")
    p.set_defaults(func=cmd_merge)


def resolve_source(spec: str) -> Path:
    """The checkpoint a source names (see the module docstring)."""
    from model.formats import CheckpointFormatError, checkpoint_kind
    from rl.checkpoint.run_specs import resolve_run_checkpoint, split_run_spec

    p = Path(spec)
    if split_run_spec(spec) is None:
        if (p / "config.json").is_file() or p.is_file():
            try:
                checkpoint_kind(p)  # asyncrl, Hugging Face or GGUF; else one line naming what is wrong
            except CheckpointFormatError as e:
                raise MergeError(str(e).splitlines()[0]) from None
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
    total = sum(weights)  # finite_float refused NaN and inf; a sum of huge weights can still overflow
    if any(w < 0 for w in weights) or not 0 < total < math.inf:
        raise MergeError(f"--weights must be >= 0, not all 0, and sum to a finite number, got {weights}")
    return [w / total for w in weights], abs(total - 1.0) > 1e-12


def read_source(source: Path):
    """A source's ModelConfig and weights by our names: an asyncrl model directory as saved (its safetensors read
    as they are, its config with its KV-cache format); a Hugging Face directory (what `rl export` writes) or a GGUF
    file through the declared conversion (model/pretrained.py). MergeError (one line) when it cannot be read."""
    from safetensors import SafetensorError

    from model.pretrained import read_state
    from model.formats import CheckpointFormatError, checkpoint_kind
    from model.pretrained import build_decoder, read_pretrained_config

    try:
        if checkpoint_kind(source) == "asyncrl":
            from model.lora import as_plain  # a LoRA run: its merged weights, so the merge averages the deltas B·A

            return as_plain(*read_state(source))  # adapters alone: on their checked base (model/checkpoint.py)
        config = read_pretrained_config(source)
        return config, build_decoder(config).state_dict()
    except CheckpointFormatError as e:  # names the file and the tensor (non-finite weights, a changed LoRA base)
        raise MergeError(str(e).splitlines()[0]) from None
    except (OSError, ValueError, SafetensorError) as e:  # ValueError: pydantic's
        raise MergeError(f"{source}: not a readable checkpoint ({str(e).splitlines()[0][:160]})") from None


def merge(sources: list[Path], weights: list[float]):
    """The merged Decoder: each parameter and buffer Σ_i w_i θ_i in float64, cast back to its dtype."""
    import torch

    from model.config import weight_differences
    from model.decoder import Decoder

    configs, states = zip(*(read_source(s) for s in sources))
    for s, c in zip(sources[1:], configs[1:]):
        if c.vocab_size != configs[0].vocab_size:
            raise MergeError(f"{s} has vocab_size={c.vocab_size} but {sources[0]} has {configs[0].vocab_size}: "
                             "merged checkpoints share one vocabulary")
        if diff := weight_differences(c, configs[0]):
            raise MergeError(f"{s} has another architecture than {sources[0]} (differs in: {', '.join(diff)})")
    longest = max(c.max_position_embeddings for c in configs)  # the longest any source ran: RoPE has no weights
    model = Decoder(configs[0].model_copy(update={"init": None, "max_position_embeddings": longest}))
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name == "lm_head.weight" and configs[0].tie_word_embeddings:  # stored once, as the embedding
                continue
            for s, st in zip(sources, states):
                if name not in st or st[name].shape != t.shape:
                    raise MergeError(f"{s} does not match its config.json: tensor {name} is "
                                     f"{'missing' if name not in st else tuple(st[name].shape)}")
                if st[name].is_floating_point() and not bool(st[name].isfinite().all()):  # 0 * NaN is NaN
                    raise MergeError(f"{s}: tensor {name} is not finite (NaN or inf): a merge of it would be too")
            acc = sum(w * st[name].double() for w, st in zip(weights, states))
            t.copy_(acc.to(t.dtype))
    return model


def cmd_merge(args: argparse.Namespace) -> int:
    try:
        out = output_dir(args.out)  # before any work: never over a directory this command did not create
        sources = [resolve_source(s) for s in args.sources]
        weights, rescaled = normalised(args.weights, len(sources))
        model = merge(sources, weights)
        from model.checkpoint import save_checkpoint

        if rescaled:
            print("weights normalised to sum 1: " + ", ".join(f"{w:.4g}" for w in weights))
        save_checkpoint(model, out, extra={"merged_from": [str(s) for s in sources], "weights": weights})
    except (MergeError, WriteRefused) as e:
        print(f"rl merge: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # the output's folder cannot be made or written (permissions, a full disk)
        print(f"rl merge: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"merged {len(sources)} checkpoints into {args.out}")
    return 0

"""A run as a model source: `RUN_DIR` or `RUN_DIR:STEP` names the run's newest verified checkpoint, or its newest
one of global step STEP (rl/checkpoint/format.py `find_checkpoint`), wherever a model is read: an OPD teacher's
`checkpoint`, a live patch's `add_teachers`, `rl merge`'s sources. Imports torch only when a spec names a run, so a
recipe without one validates without it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def split_run_spec(spec: str | Path) -> tuple[Path, int | None] | None:
    """(run directory, global step or None) when `spec` is `RUN_DIR` or `RUN_DIR:STEP` of a run directory
    (one holding `checkpoints/` or `run.json`); None when it names anything else (a model, a file)."""
    text, step = str(spec), None
    head, sep, tail = text.rpartition(":")
    if sep and head and tail.isdigit():
        text, step = head, int(tail)
    path = Path(text).expanduser()
    if (path / "checkpoints").is_dir() or (path / "run.json").is_file():
        return path, step
    return None


def resolve_run_checkpoint(spec: str | Path, warn: Callable[[str], None] = print) -> Path:
    """The checkpoint `RUN_DIR[:STEP]` names (find_checkpoint), or `spec` itself when it names no run
    directory: where a model source (rl merge, an OPD teacher) may be a whole run."""
    run = split_run_spec(spec)
    if run is None:
        return Path(spec)
    from rl.checkpoint.format import find_checkpoint  # torch: only when `spec` is a run

    return find_checkpoint(*run, warn=warn)


def resolve_teacher_runs(teachers):
    """A teacher list (raw recipe data, before validation) whose `checkpoint: RUN_DIR[:STEP]` entries are
    replaced by the checkpoint they name (resolve_run_checkpoint), so that a trained run can
    teach as it is and the recipe saved with the student's run records which checkpoint taught it."""
    if not isinstance(teachers, list):
        return teachers
    out = []
    for t in teachers:
        ckpt = t.get("checkpoint") if isinstance(t, dict) else None
        if isinstance(ckpt, (str, Path)) and split_run_spec(ckpt) is not None:
            try:
                t = {**t, "checkpoint": str(resolve_run_checkpoint(ckpt, warn=lambda _m: None))}
            except ValueError as e:
                raise ValueError(f"teacher {t.get('name')!r}: {ckpt}: {e}") from None
        out.append(t)
    return out

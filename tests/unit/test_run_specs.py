"""`RUN_DIR:STEP` and `--step` name a checkpoint of one global step (rl/checkpoint/run_specs.py, rl/checkpoint/
format.py `find_checkpoint`): it is verified like the newest one (a damaged checkpoint of that step is never
handed to a loader), the newest verified one of the step wins, and a run directory without any verified
checkpoint is one line, not a model path that fails later."""

import json

import pytest

from rl.checkpoint.format import CheckpointManager, find_checkpoint
from rl.checkpoint.run_specs import resolve_run_checkpoint, split_run_spec
from tests.unit.test_checkpoint import _write


def _run(tmp_path):
    run = tmp_path / "run"
    mgr = CheckpointManager(run / "checkpoints", keep_last=5, warn=lambda m: None)
    older, newer = _write(mgr, 4, b"a" * 100), _write(mgr, 4, b"b" * 100)
    last = _write(mgr, 8, b"c" * 100)
    return run, older, newer, last


def test_an_explicit_step_is_the_newest_verified_checkpoint_of_that_step(tmp_path):
    run, older, newer, last = _run(tmp_path)
    assert split_run_spec(f"{run}:4") == (run, 4) and split_run_spec(run) == (run, None)
    assert find_checkpoint(run, 4) == newer == resolve_run_checkpoint(f"{run}:4")
    assert resolve_run_checkpoint(run) == last == find_checkpoint(run, 8)
    (newer / "model.safetensors").write_bytes(b"b" * 99 + b"x")  # damaged: the step's other checkpoint is taken
    assert find_checkpoint(run, 4) == older == resolve_run_checkpoint(f"{run}:4")
    (older / "model.safetensors").write_bytes(b"a" * 50)  # both damaged: refused, never loaded
    with pytest.raises(ValueError, match="no verified checkpoint of step 4"):
        resolve_run_checkpoint(f"{run}:4")
    with pytest.raises(ValueError, match="no verified checkpoint of step 5"):
        find_checkpoint(run, 5)


def test_a_run_directory_without_checkpoints_is_refused_with_one_line(tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "x"}))
    assert split_run_spec(f"{run}:3") == (run, 3)
    with pytest.raises(ValueError, match="no verified checkpoint"):
        resolve_run_checkpoint(run)
    model = tmp_path / "model"  # anything else is a model path, as given
    model.mkdir()
    assert split_run_spec(model) is None and resolve_run_checkpoint(model) == model

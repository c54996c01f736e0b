"""When a checkpoint is written, what a resume refuses and in which order, and the format checks the
damage tests (test_checkpoint.py, test_checkpoint_format.py) do not reach. No model: stand-in files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import file_digest
from rl.checkpoint.format import CheckpointError, CheckpointManager, save_tree
from rl.algo.records import controller_to_record
from rl.checkpoint.preempt import PreemptionGuard
from rl.recipe_io import recipe_from_yaml, recipe_to_yaml
from rl.algo.resume import Checkpointer, ResumePoint, find_resume_point
from rl.store.trajectories import TrajectoryStore, Watermark
from tests.unit.test_checkpoint import _write, _yaml, minimal_recipe_dict
from tests.unit.test_store import make_sample


def test_a_checkpoint_is_due_every_n_steps_once_per_step_and_after_a_signal(tmp_path):
    ck = Checkpointer(CheckpointManager(tmp_path), every_steps=2)
    assert [ck.wanted(s) for s in range(5)] == [False, False, True, False, True]  # never before the first step
    ck.last_step = 2  # what `save` records: the loop comes back to this step's next token boundaries
    assert not ck.wanted(2) and ck.wanted(4)
    ck.guard = PreemptionGuard()
    ck.guard.request()
    assert ck.wanted(2) and ck.wanted(3)  # a signal: at the next token boundary, whatever the step
    assert not Checkpointer(None, every_steps=2).wanted(2)  # a bench driving one stage writes nothing


def test_a_resumed_job_does_not_write_the_checkpoint_it_resumed_from_again(tmp_path):
    ck = Checkpointer(CheckpointManager(tmp_path), every_steps=2, resume_from=ResumePoint(tmp_path / "x", 1, 4, 0.5, {}))
    assert not ck.wanted(4) and ck.wanted(6)


def _recipe(**changes):
    d = minimal_recipe_dict()
    d.update(changes)
    return recipe_from_yaml(_yaml(d))


def _checkpoint(mgr: CheckpointManager, recipe, wm: Watermark, step: int = 4) -> Path:
    """A checkpoint whose controller record is complete (an SFT stage), with stand-in weights."""
    tmp = mgr.begin(step)
    save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text("{}")
    save_tree({"torch_rng": torch.get_rng_state()}, tmp)
    driver = {"stage_idx": 0, "stage_type": "sft", "global_step": step, "stage_minutes": 0.5, "summary": {},
              "recipe_yaml": recipe_to_yaml(recipe), "num_workers": 1, "watermark": wm, "stage_end": None}
    return mgr.commit(tmp, step, controller_to_record(driver, {"step": step, "drawn": 16 * step,
                                                               "rng": random.Random(0).getstate()}))


@pytest.mark.parametrize("refusal, changed", [
    ("the recipe changes datasets", {"datasets": [{"type": "arithmetic", "name": "arith", "num_heldout": 8, "max_digits": 5}]}),
    ("the recipe changes effort", {"effort": {"levels": [10, 100]}}),
    ("the recipe changes model", {"model": {"hidden_size": 32, "head_dim": 8}}),
    ("the stages change from", {"stages": [{"type": "grpo", "max_steps": 10}]}),
])
def test_a_refused_resume_leaves_the_store_as_it_was(tmp_path, refusal, changed):
    store = TrajectoryStore.for_run_dir(tmp_path / "run")
    store.add_samples([make_sample("s0")])
    wm = store.watermark(4)
    store.add_samples([make_sample("s1")])  # after the checkpoint
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", warn=lambda m: None)
    path = _checkpoint(mgr, _recipe(), wm)
    with pytest.raises(CheckpointError, match=refusal):
        find_resume_point(_recipe(**changed), store, mgr, say=lambda m: None)
    assert store.get_sample("s1") is not None and store.restarts() == []
    point = find_resume_point(_recipe(), store, mgr, say=lambda m: None)  # the same recipe resumes
    assert (point.path, point.global_step) == (path, 4) and store.get_sample("s1") is None
    store.close()


def test_a_run_that_never_wrote_a_checkpoint_starts_over_from_an_empty_store(tmp_path):
    store = TrajectoryStore.for_run_dir(tmp_path / "run")
    store.add_samples([make_sample("s0")])
    store.add_config_version(1, "applied", {}, train_step=0)
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", warn=lambda m: None)
    assert find_resume_point(_recipe(), store, mgr, say=lambda m: None) is None
    assert store.count_samples() == 0 and store.config_versions() == []  # the redone run reuses the same ids
    store.add_samples([make_sample("s0")])
    store.close()


def test_a_checkpoint_name_is_never_reused_after_the_oldest_of_its_step_is_pruned(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, warn=lambda m: None)
    names = [_write(mgr, 12, payload=bytes([65 + i]) * 8).name for i in range(3)]  # e.g. periodic, SIGTERM, stage end
    assert names == ["step-00000012-000", "step-00000012-001", "step-00000012-002"]
    assert mgr.complete() == [tmp_path / names[-1]] and mgr.latest() == tmp_path / names[-1]


@pytest.mark.parametrize("layout", [99, None])
def test_a_checkpoint_of_another_inflight_state_layout_is_refused(tmp_path, layout):
    mgr = CheckpointManager(tmp_path, warn=lambda m: None)
    _write(mgr, 4)
    path = _write(mgr, 8)
    manifest = json.loads((path / "MANIFEST.json").read_text())  # the manifest is not in its own digest table
    (path / "MANIFEST.json").write_text(json.dumps(dict(manifest, rollout_state_format=layout)))
    with pytest.raises(CheckpointError, match=f"in-flight states of layout {layout}; this asyncrl reads layout"):
        mgr.latest()


class Killed(Exception):
    pass


def test_a_write_killed_before_its_manifest_leaves_no_checkpoint(tmp_path, monkeypatch):
    warnings = []
    mgr = CheckpointManager(tmp_path, warn=warnings.append)
    good = _write(mgr, 4)

    def killed(name):
        raise Killed(name)  # stands for the SIGKILL of rl/faults.py, inside the process

    monkeypatch.setattr("rl.checkpoint.format.fault_point", killed)
    with pytest.raises(Killed, match="checkpoint_write"):
        _write(mgr, 8)
    assert mgr.complete() == [good] and mgr.latest() == good and warnings == []
    monkeypatch.undo()
    assert _write(mgr, 8) == tmp_path / "step-00000008-000" and not list(tmp_path.glob(".tmp-*"))


def test_a_trainer_record_naming_a_missing_tensor_is_skipped(tmp_path):
    """Digests rewritten to fit: the structure of trainer.json is still checked against trainer.safetensors."""
    warnings = []
    mgr = CheckpointManager(tmp_path, warn=warnings.append)
    good, bad = _write(mgr, 4), _write(mgr, 8)
    (bad / "trainer.json").write_text(json.dumps({"format": 2, "tree": {"dict": [["torch_rng", {"tensor": "t7"}]]}}))
    manifest = json.loads((bad / "MANIFEST.json").read_text())
    manifest["files"]["trainer.json"] = {"bytes": (bad / "trainer.json").stat().st_size, "blake2b": file_digest(bad / "trainer.json")}
    (bad / "MANIFEST.json").write_text(json.dumps(manifest))
    assert mgr.latest() == good
    assert len(warnings) == 1 and "unreadable" in warnings[0] and "no tensor 't7'" in warnings[0]

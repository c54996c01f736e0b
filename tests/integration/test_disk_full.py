"""A checkpoint that cannot be written (a full disk) stops the job with one line; the previous checkpoint
and nothing half-written stay, and the run resumes from it once there is room (issue #13)."""

import errno

import pytest
import yaml

from rl.checkpoint.format import CheckpointError, CheckpointManager
from rl.algo.driver import train
from rl.recipe_io import load_recipe
from tests.integration.test_run_dir_ownership import TINY

pytestmark = pytest.mark.integration


def test_a_full_disk_stops_the_job_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import rl.checkpoint.format as ck

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY, "stages": [{**TINY["stages"][0], "max_steps": 4}]}))
    recipe, run = load_recipe(path), tmp_path / "run"
    real, calls = ck.publish_directory, []

    def fills_up(tmp, final, manifest, before_manifest=None, **kwargs):
        calls.append(final.name)
        if len(calls) == 2:  # the second checkpoint: the disk is full
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, final, manifest, before_manifest, **kwargs)

    monkeypatch.setattr(ck, "publish_directory", fills_up)
    with pytest.raises(CheckpointError) as e:
        train(recipe, run, say=lambda m: None)
    msg = str(e.value)
    assert "\n" not in msg and "the checkpoint of train step 2 could not be written (OSError: [Errno 28] No space left" in msg
    assert msg.endswith("resumes from step-00000001-000 once the disk has room")
    mgr = CheckpointManager(run / "checkpoints")
    assert [p.name for p in mgr.complete()] == ["step-00000001-000"] and mgr.latest() is not None
    assert not list((run / "checkpoints").glob(".tmp-*"))  # nothing half-written left behind
    monkeypatch.setattr(ck, "publish_directory", real)  # room again
    summary = train(recipe, run, say=lambda m: None, resume=True)
    assert "grpo_acc" in summary and CheckpointManager(run / "checkpoints").latest().name.startswith("step-00000004-")

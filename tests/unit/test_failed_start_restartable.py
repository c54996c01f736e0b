"""A fresh job that fails while it starts (its workers, a KV pool that does not fit, Ctrl-C) leaves its run directory
as it found it (issue 40, class 7): the artifacts it had begun (run.json, recipe.yaml, the store, metrics) go, what
was there before stays, and the same `rl train` command runs again instead of refusing "already holds a run"."""

import pytest

from rl.algo import job as job_module
from rl.checkpoint.run_dir import claim_for_new_run, holds_run
from rl.config import Recipe

RECIPE = {"run": {"name": "start", "seed": 0, "num_threads": 1},
          "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                    "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 32}},
          "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 2, "num_heldout": 4}],
          "engine": {"max_batch_size": 8, "block_size": 4, "max_seq_len": 32, "max_new_tokens": 6},
          "runtime": {"ray": False}, "stages": [{"type": "sft", "max_steps": 1, "batch_size": 2}],
          "logging": {"wandb": False, "progress_bar": False}}


class _Boom(Exception):
    pass


@pytest.mark.parametrize("error", [_Boom("the workers did not start"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failed_start_leaves_the_directory_restartable(tmp_path, monkeypatch, error):
    def failing_runtime(*args, **kwargs):
        raise error

    monkeypatch.setattr(job_module, "Runtime", failing_runtime)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(type(error)):
        with job_module.open_job(Recipe.model_validate(RECIPE), run_dir, say=lambda m: None):
            pass
    assert holds_run(run_dir) == []
    assert sorted(p.name for p in run_dir.iterdir() if p.name != ".lock") == ["notes.txt"]
    claim_for_new_run(run_dir, overwrite=False)  # the same command would start: no "already holds a run"

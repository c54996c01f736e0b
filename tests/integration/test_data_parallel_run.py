"""`rl train` end to end with two Ray policy workers training through DDP over gloo (runtime.parallel: ddp,
rl/parallel.py): the job finishes its steps, and the checkpoint it writes holds full weights that load."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def test_rl_train_with_two_ddp_workers(tmp_path):
    from model.checkpoint import load_weights_into
    from rl.checkpoint import find_checkpoint
    from rl.recipe_io import recipe_from_yaml
    from rl.worker import build_policy

    run = tmp_path / "run"
    sets = ["runtime.ray=true", "runtime.num_workers=2", "runtime.num_cpus=2", "runtime.cpus_per_worker=0.5",
            "runtime.parallel=ddp", "runtime.worker_timeout_s=120"]
    proc = subprocess.run([*CLI, "train", "configs/tiny_grpo.yaml", "--run-dir", str(run),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "policy on 2 Ray worker(s)" in proc.stdout and "stage 0 (grpo): 2 steps so far" in proc.stdout, proc.stdout
    recipe = recipe_from_yaml(open("configs/tiny_grpo.yaml").read())
    load_weights_into(build_policy(recipe), find_checkpoint(run))  # full tensors of the recipe's shapes

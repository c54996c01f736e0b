"""`rl train` end to end with two Ray policy workers training through DDP over gloo (runtime.parallel: ddp,
rl/train/parallel.py): the job finishes its steps, and the checkpoint it writes holds full weights that load. The
workers' placement group (rl/runtime/placement.py): a group the cluster cannot hold fails at once in one line, a busy
cluster after the timeout, and the workers run inside their bundles."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def test_rl_train_with_two_ddp_workers(tmp_path):
    from model.pretrained import load_weights_into
    from rl.checkpoint.format import find_checkpoint
    from rl.recipe_io import recipe_from_yaml
    from rl.runtime.worker import build_policy

    run = tmp_path / "run"
    # two PPO mini-batches a step (GRPOStage.mini_batches): each rank takes two optimizer steps on its share of each
    sets = ["runtime.ray=true", "runtime.num_workers=2", "runtime.num_cpus=2", "runtime.cpus_per_worker=0.5",
            "runtime.parallel=ddp", "runtime.worker_timeout_s=120", "stages.0.prompts_per_step=4",
            "stages.0.mini_batches=2", "stages.0.skip_uniform_groups=false", "stages.0.dispatch.max_inflight=8"]
    proc = subprocess.run([*CLI, "train", "configs/tiny_grpo.yaml", "--run-dir", str(run),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "policy on 2 Ray worker(s)" in proc.stdout and "stage 0 (grpo): 2 steps so far" in proc.stdout, proc.stdout
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "rl/loss" in r]
    assert len(steps) == 2 and all(r["train/optimizer_steps"] == 2 for r in steps)
    recipe = recipe_from_yaml(open("configs/tiny_grpo.yaml").read())
    load_weights_into(build_policy(recipe), find_checkpoint(run))  # full tensors of the recipe's shapes


def test_workers_the_cluster_cannot_hold_fail_at_once_in_one_line(tmp_path):
    # three workers of one CPU each on a Ray of two CPUs: the placement group can never be ready, so the job says so
    # before any worker starts, instead of waiting runtime.worker_start_timeout_s (an hour here) for a third CPU
    sets = ["runtime.ray=true", "runtime.num_workers=3", "runtime.num_cpus=2", "runtime.cpus_per_worker=1",
            "runtime.worker_start_timeout_s=3600", "stages.0.prompts_per_step=3", "stages.0.dispatch.max_inflight=6"]
    proc = subprocess.run([*CLI, "train", "configs/tiny_grpo.yaml", "--run-dir", str(tmp_path / "run"),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rl train:")]
    assert lines == [
        "rl train: the Ray cluster cannot hold 3 policy workers (placement group, runtime.placement_strategy PACK): "
        "3 x {CPU: 1} do not fit: the cluster's 1 node(s) have {CPU: 2} in all and hold 2; lower "
        "runtime.num_workers or runtime.cpus_per_worker, or add nodes"], proc.stderr[-3000:]


def test_workers_run_in_their_bundles_and_a_busy_cluster_fails_after_the_timeout():
    """rl/runtime/placement.py on a real local Ray: while another group holds both CPUs, a group that fits the cluster
    but finds no room fails after its timeout naming what is free; once room is back, what is scheduled with
    rank r's options (as its actor is) runs inside the group on its bundle's CPU, and releasing the group returns
    the CPUs."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rl.runtime.placement import PlacementError, actor_options, release, reserve

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        other_job = placement_group([{"CPU": 2.0}])
        assert other_job.wait(60)
        with pytest.raises(PlacementError, match=r"^the placement group of 2 policy workers x \{CPU: 1\} \(PACK\) was "
                                                 r"not ready within 1 s \(runtime.worker_start_timeout_s\): the cluster "
                                                 r"has \{CPU: 0\} free; other jobs hold the rest$"):
            reserve(2, {"CPU": 1.0}, "PACK", timeout_s=1)
        remove_placement_group(other_job)
        group = reserve(2, {"CPU": 1.0}, "PACK", timeout_s=60)

        @ray.remote(num_cpus=1)
        def where() -> tuple[str, int]:
            ctx = ray.get_runtime_context()
            return ctx.get_placement_group_id(), ctx.get_assigned_resources().get("CPU", 0)

        placed = ray.get([where.options(**actor_options(group, r)).remote() for r in range(2)])
        assert placed == [(group.id.hex(), 1.0)] * 2
        release(group)
        assert reserve(2, {"CPU": 1.0}, "STRICT_PACK", timeout_s=60) is not None  # the CPUs came back
    finally:
        ray.shutdown()

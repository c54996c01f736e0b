"""Preemption and resume through the real CLI: SIGTERM mid-rollout, kill -9 (external and at fail
points inside the checkpoint write and the train phase), a damaged checkpoint, an incompatible recipe.
With deterministic settings (in-process runtime, fixed seeds) every interrupted run, once resumed,
must store exactly the uninterrupted run's trained samples and losses."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml

from rl.checkpoint import CheckpointManager, inflight_file
from rl.store import TrajectoryStore, recorded_train_steps

pytestmark = pytest.mark.integration

RECIPE = {
    "run": {"name": "resume", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128,
              "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}},
    "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 2, "slip_rate": 0.7, "num_heldout": 16}],
    "engine": {"max_batch_size": 32, "max_seq_len": 96, "max_new_tokens": 48},
    "runtime": {"ray": False},
    "stages": [{"type": "sft", "max_steps": 60, "batch_size": 16, "optim": {"lr": 3e-3}},
               {"type": "grpo", "max_steps": 6, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8,
                "steps_per_call": 4, "dispatch": {"policy": "sample", "max_inflight": 24, "max_version_lag": 2}}],
    "checkpoint": {"every_steps": 4, "keep_last": 2},
    "logging": {"wandb": False, "progress_bar": False},
}
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def _start(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _run(*args, env=None) -> subprocess.CompletedProcess:
    p = _start(*args, env=env)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def _wait_for_grpo_steps(proc, run_dir, n: int) -> None:
    deadline = time.monotonic() + 240
    while recorded_train_steps(run_dir) < n:
        assert proc.poll() is None, f"run ended before {n} GRPO steps: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _trained(run_dir):
    with sqlite3.connect(f"{run_dir}/trajectories.db") as c:
        samples = {r[0]: r[1:] for r in c.execute(
            "select sample_id, response_tokens, behavior_logprobs, reward, train_step from samples where train_step is not null")}
        losses = {r[0]: json.loads(r[1])["rl/loss"] for r in c.execute("select step, metrics_json from train_steps")}
    return samples, losses


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


@pytest.fixture(scope="module")
def reference(recipe_file):
    run_dir = recipe_file.parent / "reference"
    proc = _run("train", str(recipe_file), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    samples, losses = _trained(run_dir)
    assert len(samples) == 6 * 4 * 4 and len(losses) == 6
    assert any(v != 0 for v in losses.values())  # the comparison below is not between all-zero losses
    return run_dir, samples, losses


def _assert_same_as_reference(run_dir, reference):
    _, samples, losses = reference
    got_samples, got_losses = _trained(run_dir)
    assert got_samples.keys() == samples.keys()
    assert [k for k in samples if got_samples[k] != samples[k]] == []
    assert got_losses == losses
    audit = TrajectoryStore.for_run_dir(run_dir).audit()
    assert audit["trained_twice"] == 0 and audit["link_mismatch"] == 0 and audit["prompts_open"] == 0, audit


def test_sigterm_mid_rollout_then_resume_equals_uninterrupted(recipe_file, reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start("train", str(recipe_file), "--run-dir", str(run_dir))
    _wait_for_grpo_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "preempted=1" in out.splitlines()[-1]
    ckpt = CheckpointManager(run_dir / "checkpoints").latest()
    assert ckpt is not None
    # the preemption checkpoint holds the in-flight samples (KV cache and all), not just weights
    assert inflight_file(ckpt, 0).stat().st_size > 1000
    resumed = _run("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "grpo_acc=" in resumed.stdout.splitlines()[-1]
    _assert_same_as_reference(run_dir, reference)


@pytest.mark.parametrize("how", ["external", "checkpoint_write", "train"])
def test_kill9_then_resume_equals_uninterrupted(recipe_file, reference, tmp_path, how):
    run_dir = tmp_path / "run"
    env = {} if how == "external" else {"ASYNCRL_FAULT": f"{how}:{2 if how == 'checkpoint_write' else 5}"}
    proc = _start("train", str(recipe_file), "--run-dir", str(run_dir), env=env)
    if how == "external":
        _wait_for_grpo_steps(proc, run_dir, 3)
        proc.kill()
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    if how == "checkpoint_write":  # the killed write left a temporary directory, never a checkpoint
        assert list((run_dir / "checkpoints").glob(".tmp-*"))
    resumed = _run("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resume: step-" in resumed.stdout
    _assert_same_as_reference(run_dir, reference)
    assert len(TrajectoryStore.for_run_dir(run_dir).restarts()) == 1


def test_damaged_checkpoint_is_skipped_for_the_previous_one(recipe_file, reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start("train", str(recipe_file), "--run-dir", str(run_dir), env={"ASYNCRL_FAULT": "train:5"})
    proc.communicate(timeout=120)
    newest = CheckpointManager(run_dir / "checkpoints").complete()[-1]
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    resumed = _run("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"skipping checkpoint {newest}" in resumed.stdout and "does not match its digest" in resumed.stdout
    _assert_same_as_reference(run_dir, reference)


def test_incompatible_recipe_is_refused_with_one_line(recipe_file, reference):
    run_dir, samples, _ = reference
    proc = _run("train", str(recipe_file), "--resume", str(run_dir), "--set", "model.hidden_size=32")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.hidden_size: 64 -> 32" in lines[0]
    assert _trained(run_dir)[0] == samples  # nothing touched

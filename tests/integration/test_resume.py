"""Preemption and resume through the real CLI: SIGTERM mid-rollout, kill -9 (external and at fail
points inside the checkpoint write and the train phase), a damaged checkpoint, an incompatible recipe,
code whose controller classes were renamed since the checkpoint, a format-1 checkpoint, poisoned pickles
planted in the run directory. With deterministic settings (in-process runtime, fixed seeds) every
interrupted run, once resumed, must store exactly the uninterrupted run's trained samples and losses."""

import json
import os
import pickle  # only to plant poisoned files that must never be loaded
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import msgpack

import pytest
import yaml

from model.checkpoint import file_digest
from rl.checkpoint.format import CheckpointManager, inflight_file
from rl.store.trajectories import TrajectoryStore, recorded_train_steps
from rollout.types import RolloutState

pytestmark = [pytest.mark.integration, pytest.mark.slow]

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
                "steps_per_call": 4, "entropy_coef": 1.0e-3,  # a loss that is never 0, whatever the rewards
                "dispatch": {"policy": "sample", "max_inflight": 24, "max_version_lag": 2}}],
    "checkpoint": {"every_steps": 4, "keep_last": 2},
    "logging": {"wandb": False, "progress_bar": False},
}
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
ROOT = Path(__file__).resolve().parents[2]


def _start(*args, env=None, cwd=None) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, cwd=cwd)


def _run(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    p = _start(*args, env=env, cwd=cwd)
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
def two_runs(recipe_file):
    """The module's two runs of the recipe, started side by side (one thread each): uninterrupted (`reference`),
    and killed with -9 at a fail point in its GRPO stage (`killed_in_grpo`)."""
    runs = {"reference": {}, "killed-in-grpo": {"ASYNCRL_FAULT": "train:5"}}
    procs = {name: _start("train", str(recipe_file), "--run-dir", str(recipe_file.parent / name), env=env)
             for name, env in runs.items()}
    return {name: (recipe_file.parent / name, proc, proc.communicate(timeout=300)) for name, proc in procs.items()}


@pytest.fixture(scope="module")
def reference(two_runs):
    run_dir, proc, (_, err) = two_runs["reference"]
    assert proc.returncode == 0, err[-2000:]
    samples, losses = _trained(run_dir)
    assert len(samples) == 6 * 4 * 4 and len(losses) == 6
    assert all(v != 0 for v in losses.values())  # the comparison below is not between all-zero losses (the entropy term)
    return run_dir, samples, losses


@pytest.fixture(scope="module")
def killed_in_grpo(two_runs):
    """A run killed with -9 at a fail point in its GRPO stage (`train:5`: optimizer stepped, store not told). The
    run is deterministic, so every test that resumes one (after its own damage) takes a copy of this one."""
    run_dir, proc, _ = two_runs["killed-in-grpo"]
    assert proc.returncode == -signal.SIGKILL
    return run_dir


def _copy_of(run_dir: Path, dest: Path) -> None:
    """A copy of a stopped run's directory (store, checkpoints and all), for a test to damage and resume."""
    shutil.copytree(run_dir, dest, symlinks=True)


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
    assert proc.returncode == 3, err[-2000:]  # preempted with a checkpoint written: a scheduler requeues on 3
    assert "preempted=1" in out.splitlines()[-1]
    ckpt = CheckpointManager(run_dir / "checkpoints").latest()
    assert ckpt is not None
    # the preemption checkpoint holds the in-flight samples (KV cache and all), not just weights
    assert inflight_file(ckpt, 0).stat().st_size > 1000
    resumed = _run("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "grpo_acc=" in resumed.stdout.splitlines()[-1]
    _assert_same_as_reference(run_dir, reference)


def test_background_checkpoints_hold_the_files_a_synchronous_write_makes(recipe_file, reference, tmp_path):
    """Periodic checkpoints written in the background (`checkpoint.background`, the default; the first write held
    back 1 s by a fail point while training goes on) hold byte for byte the weights, optimizer, RNG and in-flight
    samples of a run that writes them in place: the state was copied at the token boundary, not read later."""
    recipe = yaml.safe_load(recipe_file.read_text())
    recipe["checkpoint"]["keep_last"] = 100  # every periodic checkpoint kept and compared, the held-back first one too
    runs = {"in_place": False, "background": True}
    for name, background in runs.items():
        recipe["checkpoint"]["background"] = background
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))

    def train(name: str) -> subprocess.CompletedProcess:
        env = {"ASYNCRL_FAULT": "checkpoint_background:1:SLEEP1.0"} if runs[name] else None
        return _run("train", str(tmp_path / f"{name}.yaml"), "--run-dir", str(tmp_path / name), env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent runs (one thread each): side by side
        procs = dict(zip(runs, pool.map(train, runs)))
    for name, proc in procs.items():
        assert proc.returncode == 0, proc.stderr[-2000:]
        _assert_same_as_reference(tmp_path / name, reference)

    def files(run_dir):
        out = {}
        for ckpt in CheckpointManager(Path(run_dir) / "checkpoints").complete():
            manifest = json.loads((ckpt / "MANIFEST.json").read_text())
            got = {name: entry["blake2b"] for name, entry in manifest["files"].items()
                   if name not in ("controller.json", "inflight-w0.msgpack")}
            # in-flight samples whole, but for the seconds each has spent generating (wall time)
            got["inflight"] = [replace(RolloutState.from_bytes(b), generate_s=0.0).to_bytes()
                               for b in msgpack.unpackb(inflight_file(ckpt, 0).read_bytes())]
            out[manifest["global_step"], manifest["stage_end"] is not None] = got
        return out

    background, in_place = files(tmp_path / "background"), files(tmp_path / "in_place")
    periodic = [k for k in background if not k[1]]
    assert periodic and background.keys() == in_place.keys()  # periodic (background) and stage-end checkpoints
    for key in background:
        assert background[key] == in_place[key], key
        assert {"model.safetensors", "trainer.safetensors", "trainer.json"} <= background[key].keys()
    assert any(background[k]["inflight"] for k in periodic)  # samples were in flight at a background checkpoint


@pytest.mark.parametrize("how", ["external", "checkpoint_write", "train"])
def test_kill9_then_resume_equals_uninterrupted(recipe_file, reference, killed_in_grpo, tmp_path, how):
    run_dir = tmp_path / "run"
    if how == "train":  # killed at the fail point `train:5` (the fixture checks the SIGKILL)
        _copy_of(killed_in_grpo, run_dir)
    else:
        env = {} if how == "external" else {"ASYNCRL_FAULT": f"{how}:2"}
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


@pytest.mark.parametrize("name", ["model.safetensors", "trainer.safetensors", "controller.json"])
def test_damaged_checkpoint_is_skipped_for_the_previous_one(killed_in_grpo, reference, tmp_path, name):
    run_dir = tmp_path / "run"
    _copy_of(killed_in_grpo, run_dir)
    newest = CheckpointManager(run_dir / "checkpoints").complete()[-1]
    damaged = newest / name
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0x01
    damaged.write_bytes(bytes(data))
    resumed = _run("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"skipping checkpoint {newest}: {name} does not match its digest" in resumed.stdout
    _assert_same_as_reference(run_dir, reference)


RENAMES = {"Ticket": "ReleasedPrompt", "FinishedMeta": "SampleDone", "_Group": "_OpenGroup", "DispatchStats": "DispatchCounters",
           "Dispatcher": "PromptDispatcher", "RolloutClock": "PhaseClock", "AsyncGRPO": "AsyncLoop", "LiveConfig": "LiveSettings",
           "TeacherSpec": "TeacherEntry", "Prompt": "DispatchedPrompt", "Problem": "TaskProblem", "Watermark": "StoreMark",
           "RolloutState": "SampleState", "GenerationRequest": "GenRequest"}
"""Every class whose instances the format-1 checkpoint pickled (and a few more), renamed."""


def _renamed_source(dest: Path) -> Path:
    """A copy of the packages with every class in RENAMES renamed (definitions and uses alike)."""
    word = re.compile(r"\b(" + "|".join(RENAMES) + r")\b")
    for pkg in ("model", "rollout", "rewards", "teachers", "rl"):
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for f in dest.rglob("*.py"):
        f.write_text(word.sub(lambda m: RENAMES[m.group(1)], f.read_text()))
    return dest


def test_a_checkpoint_survives_renaming_the_controller_classes(killed_in_grpo, reference, tmp_path):
    run_dir = tmp_path / "run"
    _copy_of(killed_in_grpo, run_dir)
    src = _renamed_source(tmp_path / "src")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the probe of the renamed code runs beside the resume
        probe = pool.submit(subprocess.run, [sys.executable, "-c", "import rl.dispatch as d, rl.algo.async_grpo as a; print("
                                             "d.__file__, hasattr(d, 'Ticket'), hasattr(d, 'ReleasedPrompt'), hasattr(a, 'PhaseClock'))"],
                            cwd=src, capture_output=True, text=True)
        resumed = _run("resume", str(run_dir), cwd=src)  # the renamed code resumes the checkpoint the original wrote
    probe = probe.result()
    assert probe.stdout.split() == [str(src / "rl" / "dispatch.py"), "False", "True", "True"], probe.stderr
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resume: step-" in resumed.stdout
    _assert_same_as_reference(run_dir, reference)


class _Poison:
    """Unpickling this creates the marker file: proof that a loader ran code from the run directory."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Poison(marker)))


def test_poisoned_pickles_in_the_run_directory_are_never_loaded(killed_in_grpo, reference, tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    _copy_of(killed_in_grpo, run_dir)
    for ckpt in CheckpointManager(run_dir / "checkpoints").complete():  # where format 1 kept its pickles
        _plant(ckpt / "controller.pkl", marker)
        _plant(ckpt / "trainer.pt", marker)
        _plant(ckpt / "inflight-w7.msgpack", marker)  # not in the manifest: never read as an in-flight state
    resumed = _run("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not marker.exists()
    _assert_same_as_reference(run_dir, reference)


def _format_1(ckpt: Path, marker: Path) -> None:
    """Turn a checkpoint into what the format-1 code wrote: controller.pkl (here a poisoned one) and a
    format-1 manifest of digests."""
    (ckpt / "controller.json").unlink()
    _plant(ckpt / "controller.pkl", marker)
    files = {p.name: {"bytes": p.stat().st_size, "blake2b": file_digest(p)} for p in sorted(ckpt.iterdir())
             if p.name != "MANIFEST.json"}
    (ckpt / "MANIFEST.json").write_text(json.dumps({"format": 1, "global_step": 66, "created_at": 0.0, "files": files}))


def test_a_format_1_checkpoint_is_refused_and_the_store_kept(reference, tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(reference[0], run_dir)
    newest = CheckpointManager(run_dir / "checkpoints").complete()[-1]
    _format_1(newest, marker)
    before = _trained(run_dir)
    for args in (["resume", str(run_dir)], ["eval", str(run_dir), "--max-problems", "2"]):
        proc = _run(*args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].endswith(
            f"checkpoint {newest} has format 1 (pickled controller state, written before format 2); "
            f"this asyncrl reads format 2: start a new run directory"), lines
    assert not marker.exists()
    assert _trained(run_dir) == before and TrajectoryStore.for_run_dir(run_dir).restarts() == []  # not rolled back


def test_resume_refuses_to_start_over_when_every_checkpoint_is_damaged(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    ckpts = CheckpointManager(run_dir / "checkpoints").complete()
    for ckpt in ckpts:
        (ckpt / "trainer.json").write_text("{}")
    before = _trained(run_dir)
    proc = _run("resume", str(run_dir))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"none of the {len(ckpts)} checkpoints" in lines[0] and "refusing to start the run over" in lines[0]
    assert proc.stdout.count("warning: skipping checkpoint") == len(ckpts)
    assert _trained(run_dir) == before and TrajectoryStore.for_run_dir(run_dir).restarts() == []


def test_incompatible_recipe_is_refused_with_one_line(recipe_file, reference):
    run_dir, samples, _ = reference
    proc = _run("train", str(recipe_file), "--resume", str(run_dir), "--set", "model.hidden_size=32")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.hidden_size: 64 -> 32" in lines[0]
    assert _trained(run_dir)[0] == samples  # nothing touched

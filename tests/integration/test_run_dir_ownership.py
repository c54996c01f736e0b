"""Run-directory ownership through the real CLI (issue #13, rl/checkpoint/run_dir.py): one job per run directory (a
second start refuses at once, naming the holder; a killed holder leaves no stale lock), a directory that
holds a run is never started over by `rl train` without --overwrite, and a resume never rolls a run with
recorded train steps back to zero."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml").read_text())


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def _one_line_exit_2(proc, *parts) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(p in lines[0] for p in parts), proc.stderr
    return lines[0]


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _copy_of(run: Path, dest: Path) -> Path:
    """A copy of a finished run (the session's `tiny_grpo_run`: `rl train` of the same recipe) for a test to change."""
    shutil.copytree(run, dest, symlinks=True)
    return dest


def test_one_job_per_run_directory_and_a_killed_holder_leaves_no_lock(tmp_path, recipe):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rl.checkpoint.run_dir import RunLock; "
                               f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        line = _one_line_exit_2(_cli("train", recipe, "--run-dir", str(run)), f"{run} is in use by pid {holder.pid} on ")
        assert time.monotonic() - t0 < 60 and "one job per run directory" in line  # at once: no waiting on the lock
        assert not (run / "recipe.yaml").exists() and not (run / "trajectories.db").exists()  # nothing touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    proc = _cli("train", recipe, "--run-dir", str(run))  # the kernel dropped the dead holder's lock
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT grpo_acc=" in proc.stdout


def test_train_into_a_run_refuses_and_overwrite_starts_over(tmp_path, recipe, tiny_grpo_run):
    run = _copy_of(tiny_grpo_run, tmp_path / "run")
    run_json = (run / "run.json").read_text()
    (run / "notes.txt").write_text("mine")
    line = _one_line_exit_2(_cli("train", recipe, "--run-dir", str(run)), f"{run} already holds a run",
                            f"rl resume {run}", "--overwrite")
    assert "checkpoints/" in line and (run / "run.json").read_text() == run_json  # refused before touching it
    proc = _cli("train", recipe, "--run-dir", str(run), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--overwrite: removed checkpoints" in proc.stdout
    assert (run / "run.json").read_text() != run_json  # a new run, a new identity
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own artifacts go
    _one_line_exit_2(_cli("train", recipe, "--resume", str(run), "--overwrite"), "give one of them")


def test_resume_without_checkpoints_never_rolls_trained_steps_back(tmp_path, tiny_grpo_run):
    run = _copy_of(tiny_grpo_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    line = _one_line_exit_2(_cli("resume", str(run)), "the run has 2 recorded train steps but no checkpoint",
                            "refusing to start it over")
    assert line.startswith("rl resume: ")
    import sqlite3

    with sqlite3.connect(run / "trajectories.db") as c:
        assert c.execute("select count(*) from train_steps").fetchone()[0] == 2  # nothing rolled back


def test_reconfigure_needs_a_running_job(tmp_path, tiny_grpo_run):
    run = _copy_of(tiny_grpo_run, tmp_path / "run")
    t0 = time.monotonic()
    _one_line_exit_2(_cli("reconfigure", str(run), "--set", "mixture.add=2"), f"no job is running in {run}", "nothing was queued")
    assert time.monotonic() - t0 < 30 and not (run / "control" / "inbox").exists()  # at once, nothing left behind


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/b", ".hidden", "with space"])
def test_run_name_is_a_plain_name(recipe, name):
    _one_line_exit_2(_cli("validate", recipe, "--set", f"run.name={name}"), "run.name", "is not a plain name")

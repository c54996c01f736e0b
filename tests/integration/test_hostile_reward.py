"""User reward code through `rl train` (issue 40, class 4): a `python:` verifier that crashes on every call stops the
job with one line and exit 2 instead of training on zeros; a job preempted while its verifier hangs writes its
checkpoint and exits 3 within seconds, and what the verifier forked does not outlive the job. In-process runtime
(the Ray path's unwrapping of the error is the CLI's `cause`; bench/abuse.py runs the default runtime)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def _recipe(tmp_path: Path, verifier: dict, rows_extra: dict | None = None) -> str:
    rows = [{"q": f"{a}+{b}=", "a": str(a + b), **(rows_extra or {})} for a in range(6) for b in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "run": {"name": "hostile", "seed": 0, "num_threads": 1},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                  "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 64}},
        "datasets": [{"type": "jsonl", "name": "add", "path": str(tmp_path / "d.jsonl"), "prompt": "q", "answer": "a",
                      "verifier": verifier, "heldout": {"fraction": 0.1}}],
        "engine": {"max_batch_size": 16, "block_size": 4, "max_seq_len": 48, "max_new_tokens": 4},
        "runtime": {"ray": False},
        "stages": [{"type": "grpo", "max_steps": 4, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 8,
                    "steps_per_call": 2, "dispatch": {"max_inflight": 8}}],
        "eval": {"max_problems": 2},
        "logging": {"wandb": False, "progress_bar": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_reward_function_that_always_crashes_stops_the_job_with_one_line(tmp_path):
    recipe = _recipe(tmp_path, {"type": "python", "function": "tests.tasks.hostile_reward_fns:always_exits",
                                "max_failures_in_a_row": 3})
    proc = subprocess.run([*CLI, "train", recipe, "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("rl train: the reward function tests.tasks.hostile_reward_fns:"
                                                    "always_exits failed 3 times in a row (last: exited (code 3))")


def test_sigterm_while_the_reward_function_hangs_checkpoints_and_exits_3_and_its_forks_end(tmp_path):
    pid_file = tmp_path / "forked.pid"
    recipe = _recipe(tmp_path, {"type": "python", "function": "tests.tasks.hostile_reward_fns:forks_and_hangs",
                                "timeout_s": None}, rows_extra={"pid_file": str(pid_file)})
    job = subprocess.Popen([*CLI, "train", recipe, "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        assert pid_file.exists(), job.communicate(timeout=60)
        forked = int(pid_file.read_text())
        time.sleep(0.5)
        t0 = time.monotonic()
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 3, (job.returncode, out[-2000:], err[-3000:])
    assert "preempted: checkpoint" in out and "Traceback" not in err
    assert took < 15, took  # was: never (the job waited on the verifier for good)
    assert not _alive(forked)

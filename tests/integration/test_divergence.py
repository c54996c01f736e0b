"""A job stops with one line at its first non-finite loss or gradient norm and keeps its last good checkpoint (issue
40, class 3): a finite but absurd lr used to train NaN into every later checkpoint and exit 0. Now `rl train` exits 5
naming the step, no checkpoint is written from the diverged weights, and `rl resume RUN --set stages.I.optim.lr=...`
continues from the last good one. The real `rl` entry point (in this process for the in-process runtime: the imports
are most of a tiny job's seconds; a subprocess for Ray), real run directory, the 20K-parameter tiny recipe."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from rl.cli import main

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
STAGES = ("stages=[{type: sft, max_steps: 2, batch_size: 4, optim: {lr: 1e-3}}, "
          "{type: sft, max_steps: 4, batch_size: 4, optim: {lr: 1e30}}]")
"""Stage 0 trains 2 good steps and ends with a checkpoint (step 2); stage 1's lr of 1e30 (finite: the recipe takes
it) moves the weights to ~1e30 at step 3, and step 4's loss or gradient is NaN."""


def _rl(capsys, ray: str, *args: str):
    """`rl ARGS` -> (returncode, stdout, stderr)."""
    if ray == "true":
        return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _finite(checkpoint: Path) -> bool:
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        return all(f.get_tensor(k).isfinite().all() for k in f.keys())


def _checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))


@pytest.mark.parametrize("ray", [pytest.param("false"), pytest.param("true", marks=pytest.mark.slow)])
def test_a_diverging_job_exits_5_keeps_its_last_good_checkpoint_and_resumes_with_a_lower_lr(tmp_path, capsys, ray):
    run = tmp_path / "run"
    proc = _rl(capsys, ray, "train", str(TINY), "--run-dir", str(run), "--set", STAGES,
               "--set", "checkpoint.every_steps=0", "--set", f"runtime.ray={ray}")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rl ")]
    assert proc.returncode == 5 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "RESULT" not in proc.stdout
    assert re.fullmatch(r"rl train: step 4: the (loss is not finite \(nan, sft/loss\)|gradient norm is (nan|inf)[^;]*)"
                        r"; "
                        r"the newest checkpoint, step-00000002-000, is the last good one: fix the recipe "
                        rf"\(a lower lr\), then rl resume {re.escape(str(run))} --set stages\.1\.optim\.lr=<lower>",
                        lines[0]), lines[0]
    assert [p.name for p in _checkpoints(run)] == ["step-00000002-000"] and _finite(_checkpoints(run)[0])

    proc = _rl(capsys, ray, "resume", str(run), "--set", "stages.1.optim.lr=1e-3", "--set", "stages.1.max_steps=2")
    assert proc.returncode == 0 and "RESULT" in proc.stdout, (proc.returncode, proc.stderr[-3000:])
    assert "resume: step-00000002-000" in proc.stdout
    newest = _checkpoints(run)[-1]
    assert newest.name == "step-00000004-000" and all(_finite(p) for p in _checkpoints(run))


def test_a_diverging_grpo_stage_with_background_checkpoints_exits_5_at_its_first_non_finite_step(tmp_path, capsys):
    """The asynchronous loop's step stops the same way; the checkpoint written in the background before it is
    committed, not lost. (The entropy bonus gives the tiny recipe's all-zero-reward groups a gradient.)"""
    run = tmp_path / "run"
    proc = _rl(capsys, "false", "train", str(TINY), "--run-dir", str(run), "--set", "stages.0.optim.lr=1e30",
               "--set", "stages.0.entropy_coef=0.1", "--set", "stages.0.max_steps=4",
               "--set", "checkpoint.background=true")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rl ")]
    assert proc.returncode == 5 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("rl train: step 2: the "), lines[0]
    assert "the newest checkpoint, step-00000001-000, is the last good one" in lines[0], lines[0]
    assert lines[0].endswith(f"then rl resume {run} --set stages.0.optim.lr=<lower>"), lines[0]
    assert [p.name for p in _checkpoints(run)] == ["step-00000001-000"] and _finite(_checkpoints(run)[0])

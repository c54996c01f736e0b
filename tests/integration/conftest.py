"""Fixtures shared by the integration modules."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


@pytest.fixture(scope="session")
def tiny_grpo_run(tmp_path_factory) -> Path:
    """A finished `rl train configs/tiny_grpo.yaml` (two GRPO steps, a checkpoint after each), trained once for the
    session. Read it only: a test that changes, resumes or trains into a run takes a copy (shutil.copytree)."""
    run = tmp_path_factory.mktemp("tiny-grpo") / "run"
    proc = subprocess.run([*CLI, "train", "configs/tiny_grpo.yaml", "--run-dir", str(run)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT grpo_acc=" in proc.stdout
    return run

"""A run directory written by an older commit's code resumes under this one (tests/fixtures/README.md):
`run-52ad3d6/` was killed with -9 in its GRPO stage by the code before rl/ moved into sub-packages, with
in-flight samples (KV cache, MoE routing) in its newest checkpoint. The layout of the code may change; the
run directory's format (checkpoint records, store, run identity) is what a user's preempted job depends on."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from rollout.types import RolloutState

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-52ad3d6"
NEWEST = "step-00000008-000"
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def _inflight_ids(ckpt: Path) -> set[str]:
    blobs = msgpack.unpackb((ckpt / "inflight-w0.msgpack").read_bytes())
    return {RolloutState.from_bytes(b).request.sample_id for b in blobs}


def test_a_run_directory_from_before_the_move_resumes(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    inflight = _inflight_ids(run_dir / "checkpoints" / NEWEST)
    assert len(inflight) >= 4  # the fixture is the hard case: samples mid-generation at the checkpoint
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]

    proc = subprocess.run([*CLI, "resume", str(run_dir)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ASYNCRL_FAULT": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resume: {NEWEST} (stage 1, train step 8)" in proc.stdout
    assert "grpo_acc=" in proc.stdout.splitlines()[-1]

    with sqlite3.connect(run_dir / "trajectories.db") as c:
        assert c.execute("select run_id from runs").fetchall() == [(run_id,)]  # the run kept its identity
        steps = [s for (s,) in c.execute("select step from train_steps order by step")]
        continued = dict(c.execute("select sample_id, status from samples where sample_id in (%s)"
                                   % ",".join("?" * len(inflight)), sorted(inflight)).fetchall())
        versions = {sid: (lo, hi) for sid, lo, hi in c.execute("select sample_id, min_version, max_version from samples")}
    assert steps == list(range(steps[0], steps[0] + 6)), steps  # the GRPO stage's six steps, none twice
    # every sample in flight at the checkpoint finished after the resume, from its exact token: its response
    # spans the policy versions before and after the checkpoint's weights
    assert continued == {sid: "finished" for sid in inflight}
    assert any(versions[sid][0] < versions[sid][1] for sid in inflight)
    from rl.store.trajectories import TrajectoryStore

    audit = TrajectoryStore.for_run_dir(run_dir).audit()
    assert audit["trained_twice"] == 0 and audit["link_mismatch"] == 0 and audit["prompts_open"] == 0, audit

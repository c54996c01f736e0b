"""`rl reconfigure` through the real CLI against a job that ends before answering (issue 40, class 2): it said
"queued" with exit 0 and left the patch in the inbox, for the next `rl resume` to apply (a patch the user was never
told the outcome of). Now: one line, exit 2, and the patch withdrawn. The job's refusals: test_reconfigure_refused.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rl import reconfigure as rc

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
HOLD_LOCK = """
import sys, time
from rl.checkpoint.run_dir import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_job_that_ends_before_answering_gets_its_patch_withdrawn(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_bytes(TINY.read_bytes())
    job = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run), "3"], stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    proc = subprocess.run([*CLI, "reconfigure", str(run), "--set", "mixture.add=2", "--wait", "60"],
                          capture_output=True, text=True, timeout=120)
    job.wait(timeout=30)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0] == "rl reconfigure: the job stopped before answering; the patch was withdrawn, nothing changed"
    assert time.monotonic() - t0 < 30  # not the whole --wait
    assert rc.pending(run) == [] and rc.answers(run) == [] and rc.claimed(run) == []

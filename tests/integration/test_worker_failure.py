"""A policy worker that hangs (SIGSTOP) or dies (SIGKILL) never hangs the job (issue #17, rl/runtime.py): two
Ray workers training data-parallel over gloo, a fail point (rl/faults.py) stops or kills rank 1 in a train
step or a rollout slice; the job exits 4 within runtime.worker_timeout_s (plus a ping's grace) with one line
naming the worker and the phase, leaves no Ray process behind, and `rl resume` with one worker continues from
the newest checkpoint: nothing trained twice, no prompt left open. With ASYNCRL_TEST_DEVICE=cuda (a machine with two
GPUs) the same runs train over NCCL, one GPU per worker."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl.store import TrajectoryStore

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
DEVICE_NAME = os.environ.get("ASYNCRL_TEST_DEVICE", "cpu")
TIMEOUT_S = 5 if DEVICE_NAME == "cpu" else 8
"""Far above any call of this tiny run on CPU (well under a second each, also with the 2 cores oversubscribed 3x);
on GPUs the first calls also compile kernels and set NCCL up."""
TWO_WORKERS = ["runtime.ray=true", "runtime.num_workers=2", "runtime.num_cpus=2", "runtime.cpus_per_worker=0.5",
               f"runtime.worker_timeout_s={TIMEOUT_S}", "stages.0.max_steps=5"]
DEVICE = [f"run.device={DEVICE_NAME}"]


def _cli(args: list[str], sets: list[str], fault: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_FAULT"}
    if fault:
        env["ASYNCRL_FAULT"] = fault
    t0 = time.monotonic()
    proc = subprocess.run([*CLI, *args, *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True,
                          timeout=300, env=env)
    return proc, time.monotonic() - t0


def _ray_processes() -> list[str]:
    """Live Ray worker processes (running, sleeping or stopped). A zombie has exited already: once its parent is
    gone, a container whose init does not reap keeps it listed, holding nothing."""
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "ray::" in line and not line.lstrip().startswith("Z")]


CASES = {  # fault -> the job's one line
    # rank 1 also takes longer to build than worker_timeout_s: the start is bounded by worker_start_timeout_s
    f"worker_init@1:1:SLEEP{TIMEOUT_S + 1},worker_train@1:3:STOP":
        f"policy worker 1 did not answer train_step within {TIMEOUT_S} s and does not answer a ping (hung or stopped)",
    "worker_rollout@1:8": "policy worker 1 died during rollout (ActorDiedError)",
}


@pytest.fixture(scope="module")
def failed_and_resumed(tmp_path_factory):
    """Each case's run (two workers, the fault on rank 1), then its `rl resume` with one worker: the cases' runs side
    by side (each its own Ray), then their resumes side by side; the Ray processes live before and after the runs."""
    runs = {fault: tmp_path_factory.mktemp("worker_failure") / "run" for fault in CASES}
    before = set(_ray_processes())
    with ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        trained = dict(zip(runs, pool.map(lambda f: _cli(["train", "configs/tiny_grpo.yaml", "--run-dir", str(runs[f])],
                                                              TWO_WORKERS + DEVICE, f), runs)))
        after = set(_ray_processes())
        resumed = dict(zip(runs, pool.map(lambda f: _cli(["resume", str(runs[f])], ["runtime.num_workers=1", *DEVICE])[0],
                                          runs)))
    return {f: (runs[f], *trained[f], resumed[f]) for f in runs}, before, after


@pytest.mark.parametrize("fault", list(CASES))
def test_a_hung_or_dead_worker_ends_the_job_with_one_line_and_resume_continues(failed_and_resumed, fault):
    cases, before, after = failed_and_resumed
    run, proc, seconds, resumed = cases[fault]
    assert proc.returncode == 4, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    ours = [s for s in proc.stderr.splitlines() if s.startswith("rl train: ")]
    assert ours == [f"rl train: {CASES[fault]}; the newest checkpoint holds: rl resume {run}"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert seconds < 120  # bounded: the timeout, a ping's grace, Ray's start and teardown
    assert after <= before  # the stopped worker was killed with the others (both runs ended by now)

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stage 0 (grpo): 5 steps so far" in resumed.stdout
    audit = TrajectoryStore.for_run_dir(run).audit()
    assert audit["trained_twice"] == 0 and audit["link_mismatch"] == 0 and audit["prompts_open"] == 0, audit

"""User reward code in its supervised child process (rewards/supervised.py, issue 40 class 4): whatever a `python:`
verifier does (exits, raises KeyboardInterrupt, kills its process, hangs, forks, floods its output, returns a
malformed Verdict) costs its sample a 0 with the true reason and the next call works; a run of such failures in a
row stops the job with one line; a preempted job does not wait behind it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from rewards import supervised
from rewards import verifiers as V
from rewards.task import Problem, Trajectory, Verdict
from rl.runtime.reward_worker import RewardWorker, verify_one

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = TypeAdapter(V.VerifierConfig)
HOSTILE = "tests.tasks.hostile_reward_fns"


def _verifier(fn: str, **options):
    return VERIFIER.validate_python({"type": "python", "function": fn, **options}).build()


def _traj(response: str = "42", answer: str = "42") -> Trajectory:
    return Trajectory.single(Problem("d:1", "d", "q", answer), response)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead: only its exit status waits to be read
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("fn, reason", [
    ("exits", "the reward function exited (code 3)"),
    ("interrupts", "the reward function raised KeyboardInterrupt"),
    ("dies", "the reward function exited (code 7)"),
    ("kills_itself", "the reward function was killed by SIGKILL"),
])
def test_a_reward_function_that_ends_its_process_scores_0_with_the_true_reason_at_once(fn, reason):
    ok = _verifier(f"{HOSTILE}:exits_on_x")
    assert ok(_traj("42"), "42", {}) == Verdict(1.0, True, "reward function: 1")  # the child is up
    bad = _verifier(f"{HOSTILE}:{fn}")
    t0 = time.monotonic()
    assert bad(_traj(), "42", {}) == Verdict(0.0, False, reason)
    assert time.monotonic() - t0 < 5  # was ~40 s ("timed out"): the death is seen at once (bench: well under 1 s)
    assert ok(_traj("42"), "42", {}).correct  # and the next call works (a fresh child where the old one died)


def test_a_malformed_or_non_finite_verdict_scores_0_with_the_reason():
    assert _verifier(f"{HOSTILE}:malformed")(_traj(), "42", {}) == Verdict(
        0.0, False, "the reward function returned a malformed Verdict (reward 'high' is not a number)")
    assert _verifier(f"{HOSTILE}:not_finite")(_traj(), "42", {}) == Verdict(
        0.0, False, "the reward function returned a malformed Verdict (reward nan is not finite)")


def test_failures_in_a_row_stop_the_job_with_one_line_and_a_good_verdict_resets_the_count():
    v = _verifier(f"{HOSTILE}:exits_on_x", max_failures_in_a_row=3)
    for response in ("x", "x", "42", "x", "x"):  # 2 failures, a success, 2 failures: no stop
        v(_traj(response), "42", {})
    with pytest.raises(V.RewardFunctionFailed) as err:
        v(_traj("x"), "42", {})
    assert str(err.value) == (f"the reward function {HOSTILE}:exits_on_x failed 3 times in a row "
                              "(last: exited (code 5))")
    malformed = _verifier(f"{HOSTILE}:malformed", max_failures_in_a_row=2)
    malformed(_traj(), "42", {})
    with pytest.raises(V.RewardFunctionFailed, match="failed 2 times in a row"):
        malformed(_traj(), "42", {})
    raises = _verifier("tests.tasks.reward_fns:raises", max_failures_in_a_row=2)  # an exception is the sample's
    for _ in range(3):
        assert raises(_traj(), "42", {}).reason == "reward function error: RuntimeError: boom"


def test_the_reward_worker_lets_the_stop_through_and_validates_what_a_task_returns():
    class Stops:
        def verify(self, t, ctx):
            raise V.RewardFunctionFailed("the reward function m:f failed 20 times in a row (last: x)")

    class Malformed:
        def verify(self, t, ctx):
            return Verdict(float("inf"), True, "inf")

    class NotAVerdict:
        def verify(self, t, ctx):
            return 1.0

    w = RewardWorker.__new__(RewardWorker)
    w.tasks, w.ctx = {"d": Stops()}, None
    with pytest.raises(V.RewardFunctionFailed, match="failed 20 times"):
        w.verify([_traj(), _traj()])
    assert verify_one(Malformed(), _traj(), None) == Verdict(
        0.0, False, "verifier returned a malformed Verdict (reward inf is not finite)")
    assert verify_one(NotAVerdict(), _traj(), None) == Verdict(0.0, False, "verifier returned 1.0, not a Verdict")


def test_a_hanging_function_and_what_it_forked_are_killed_at_its_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    v = _verifier(f"{HOSTILE}:forks_and_hangs", timeout_s=1.0)
    assert v(_traj(), "42", {"pid_file": str(pid_file)}) == Verdict(
        0.0, False, "the reward function did not return within 1 s")
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # a loaded machine delays the kill's delivery, never prevents it
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)  # its whole process group went with it


def test_a_job_that_dies_takes_the_reward_functions_processes_with_it(tmp_path):
    """The reward worker (here a plain process) killed with SIGKILL, as `ray.kill` ends a reward actor: the child and
    what the reward function forked end too (the child's watchdog kills its process group)."""
    pid_file = tmp_path / "pid"
    code = ("from pydantic import TypeAdapter; from rewards import verifiers as V; from rewards.task import Problem, "
            "Trajectory; import sys; v = TypeAdapter(V.VerifierConfig).validate_python({'type': 'python', 'function': "
            f"'{HOSTILE}:forks_and_hangs', 'timeout_s': 600}}).build(); "
            f"v(Trajectory.single(Problem('d:1', 'd', 'q', '1'), '1'), '1', {{'pid_file': {str(pid_file)!r}}})")
    job = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        forked = int(pid_file.read_text())
        assert _alive(forked)
    finally:
        job.kill()
        job.wait()
    deadline = time.monotonic() + 30
    while _alive(forked) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(forked)


def test_output_is_captured_and_capped_not_poured_into_the_jobs_streams():
    """50 MiB printed by the function: the job's own stdout and stderr get at most the per-call cap (64 KiB)."""
    code = ("from pydantic import TypeAdapter; from rewards import verifiers as V; from rewards.task import Problem, "
            "Trajectory; v = TypeAdapter(V.VerifierConfig).validate_python({'type': 'python', 'function': "
            f"'{HOSTILE}:floods'}}).build(); "
            "print('VERDICT', v(Trajectory.single(Problem('d:1', 'd', 'q', '1'), '1'), '1', {}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"VERDICT Verdict(reward=1.0, correct=True" in proc.stdout
    assert len(proc.stdout) + len(proc.stderr) < 2 * supervised.OUTPUT_KEPT + 4096
    assert b"bytes of the reward function's output dropped" in proc.stderr


def test_preemption_cuts_a_call_short_within_a_second():
    """What SIGTERM asks (RewardWorker.cut_short): a reward function without a time limit that never returns is
    stopped a second after it, its sample scored 0 with that reason; a new worker (a resumed job) calls again."""
    v = _verifier(f"{HOSTILE}:sleeps", timeout_s=None)
    _verifier(f"{HOSTILE}:exits_on_x")(_traj(), "42", {})  # the child is up
    out = []
    caller = threading.Thread(target=lambda: out.append(v(_traj(), "42", {})))
    caller.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    worker = RewardWorker.__new__(RewardWorker)
    worker.cut_short()
    caller.join(10)
    assert out == [Verdict(0.0, False, "the reward function was cut short: the job is stopping")]
    assert time.monotonic() - t0 < 3
    supervised.reset_cut_short()  # what a new RewardWorker does
    assert _verifier(f"{HOSTILE}:exits_on_x")(_traj(), "42", {}).correct

"""Reward functions with the bugs a user's reward code has (issue 40, class 4), for
`verifier: python:tests.tasks.hostile_reward_fns:<fn>`: each must cost its sample a 0 with the true reason, never
the job (tests/unit/test_verifier_child.py, tests/integration/test_hostile_reward.py, bench/abuse.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rewards import Trajectory, Verdict


def exits(trajectory: Trajectory, answer: str, row: dict) -> float:
    sys.exit(3)


def interrupts(trajectory: Trajectory, answer: str, row: dict) -> float:
    raise KeyboardInterrupt


def dies(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Ends its process without unwinding (no exception to catch)."""
    os._exit(7)


def kills_itself(trajectory: Trajectory, answer: str, row: dict) -> float:
    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def sleeps(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Never returns, blocked in a system call (no bytecode runs)."""
    time.sleep(10**6)
    return 1.0


def forks_and_hangs(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Starts a long-lived process (its pid written to the file `row["pid_file"]`), then never returns."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(row["pid_file"], "w") as f:
        f.write(str(child.pid))
    time.sleep(10**6)
    return 1.0


def floods(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Prints 50 MiB, on both streams, then answers."""
    line = "x" * 1023 + "\n"
    for _ in range(25 * 1024):
        sys.stdout.write(line)
        sys.stderr.write(line)
    return 1.0


def malformed(trajectory: Trajectory, answer: str, row: dict) -> Verdict:
    return Verdict("high", "yes", 3)  # type: ignore[arg-type]


def not_finite(trajectory: Trajectory, answer: str, row: dict) -> Verdict:
    return Verdict(float("nan"), True, "nan")


def exits_on_x(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Crashes on a response "x", else rewards the exact answer."""
    if trajectory.response == "x":
        os._exit(5)
    return float(trajectory.response == answer)


def always_exits(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Every call ends its process: a job on it must stop, not train on zeros."""
    os._exit(3)

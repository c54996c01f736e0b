"""Fail points for crash testing (bench/crash_resume.py, tests): `ASYNCRL_FAULT=<point>[@<rank>]:<n>[:STOP]`
makes the process SIGKILL itself (with `:STOP`, SIGSTOP: a hung process; with `:SLEEP<s>`, it sleeps s seconds:
a slow one) the n-th time it reaches `fault_point("<point>")`; `@<rank>` limits it to the policy worker of that
rank; several specs are separated by commas. Points: `checkpoint_write` (checkpoint files written, manifest not
yet), `train` (optimizer step taken, store not yet told), and in the policy workers `checkpoint_background` (a
background checkpoint write begins, on its thread), `worker_init` (a worker is
being built), `worker_rollout` (a rollout slice begins) and `worker_train` (a train step begins).
Ray actors get the variable from the driver (rl/runtime/groups.py). Unset, a fail point is one dictionary lookup."""

from __future__ import annotations

import os
import signal
import time

_counts: dict[str, int] = {}


def fault_point(name: str, rank: int | None = None) -> None:
    spec = os.environ.get("ASYNCRL_FAULT")
    if not spec:
        return
    for one in spec.split(","):
        point, _, rest = one.partition(":")
        point, _, only_rank = point.partition("@")
        if point != name or (only_rank and rank != int(only_rank)):
            continue
        n, _, how = rest.partition(":")
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] != int(n or 1):
            continue
        if how.startswith("SLEEP"):
            time.sleep(float(how[5:]))
        else:
            os.kill(os.getpid(), signal.SIGSTOP if how == "STOP" else signal.SIGKILL)

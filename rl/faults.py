"""Fail points for crash testing (bench/crash_resume.py, tests): `ASYNCRL_FAULT=<point>:<n>` makes the
process SIGKILL itself the n-th time it reaches `fault_point("<point>")`. Points: `checkpoint_write`
(checkpoint files written, manifest not yet), `train` (optimizer step taken, store not yet told).
Unset, a fail point is one dictionary lookup."""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("ASYNCRL_FAULT")
    if not spec:
        return
    point, _, n = spec.partition(":")
    if point != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)

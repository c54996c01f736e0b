"""Graceful preemption (seed §5.1.2: jobs on preemptible pools must stop promptly and resume).

The first SIGTERM or SIGINT only sets `requested`: the training loops reach a token boundary (at most
`steps_per_call` engine steps, or the end of the current optimizer step), persist every in-flight
sample and write a checkpoint, and `rl train` exits 0. A second signal exits at once with status
128 + signal number, writing nothing more (the last complete checkpoint stays valid).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


class Preempted(Exception):
    """Raised by the driver after the preemption checkpoint is written."""

    def __init__(self, checkpoint: str):
        super().__init__(checkpoint)
        self.checkpoint = checkpoint


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signal_time: float | None = None
        self._previous: dict[int, object] = {}

    def request(self) -> None:
        """What the first signal does; also callable directly (tests, embedding)."""
        self.requested = True
        self.signal_time = time.monotonic()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.request()
        print(f"rl: {signal.Signals(signum).name}: checkpointing at the next token boundary, then exiting "
              f"(send it again to exit now)", file=sys.stderr, flush=True)

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

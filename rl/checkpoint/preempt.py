"""Graceful preemption (seed §5.1.2: jobs on preemptible pools must stop promptly and resume).

The first SIGTERM or SIGINT only sets `requested`: the training loops reach a token boundary (at most
`steps_per_call` engine steps, or the end of the current optimizer step), persist every in-flight
sample and write a checkpoint, and `rl train` exits 3 (preempted, resumable). A second signal exits
within a few seconds with status 128 + signal number, writing nothing more (the last complete checkpoint
stays valid): Ray is shut down (bounded) and any process the job started that is still alive is
killed, so no Ray agent or worker outlives it.
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
        self.on_request: list = []
        """Callables run by the first signal (in the handler: each must only start work, never wait), e.g. the reward
        workers' `cut_short`, so that nothing the checkpoint waits on runs user code for long."""
        self._previous: dict[int, object] = {}

    def request(self) -> None:
        """What the first signal does; also callable directly (tests, embedding)."""
        self.requested = True
        self.signal_time = time.monotonic()
        for callback in self.on_request:
            callback()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            stop_children()
            os._exit(128 + signum)
        self.request()
        print(f"rl: {signal.Signals(signum).name}: checkpointing at the next token boundary, then exiting "
              f"(send it again to exit now)", file=sys.stderr, flush=True)

    def install(self) -> "PreemptionGuard":
        """Take SIGTERM/SIGINT (from the main thread; elsewhere a no-op). Install it after `ray.init`, which
        sets its own SIGTERM handler, and keep it through the job's teardown."""
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous.setdefault(s, signal.signal(s, self._handle))
        return self

    def restore(self) -> None:
        """Give the signals back to the handlers from before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __enter__(self) -> "PreemptionGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def stop_children(ray_timeout_s: float = 3.0, kill_timeout_s: float = 2.0) -> None:
    """Before an immediate exit: `ray.shutdown()` on a side thread for at most `ray_timeout_s`, then
    terminate (and after `kill_timeout_s`, kill) every descendant process still alive."""
    if "ray" in sys.modules:
        ray = sys.modules["ray"]
        if ray.is_initialized():
            t = threading.Thread(target=ray.shutdown, daemon=True)
            t.start()
            t.join(ray_timeout_s)
    try:
        import psutil
    except ImportError:  # ray depends on psutil; without ray there are no children to stop
        return
    children = psutil.Process().children(recursive=True)
    for c in children:
        try:
            c.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=kill_timeout_s)
    for c in alive:
        try:
            c.kill()
        except psutil.Error:
            pass

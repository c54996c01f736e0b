"""The progress bar shows the budget that binds (issue #13): a resumed stage's bar starts at its step, and
with a wall-clock budget the bar's total is what the time left allows at the rate so far, not max_steps."""

import io
import time

from rl.config import GRPOStage
from rl.algo.job import Progress


class _Sink:
    def log(self, metrics, step):
        pass


def _progress(stage, start, deadline):
    p = Progress(True, lambda m: None, _Sink(), time.monotonic(), file=io.StringIO())
    p.start_stage(0, stage)
    p.begin_steps(start, deadline)
    return p


def test_a_time_budget_sets_the_total_from_the_rate():
    stage = GRPOStage(max_steps=1000, max_minutes=1.0)
    p = _progress(stage, 0, time.monotonic() + 0.5)  # half a second left
    for _ in range(5):
        time.sleep(0.02)
        p.step({})
    assert p.bar.n == 5 and 5 < p.bar.total < 60  # ~0.1 s for 5 steps: ~25 more fit, nowhere near 1000


def test_steps_bind_when_time_is_plenty_and_a_resume_starts_at_its_step():
    stage = GRPOStage(max_steps=50, max_minutes=60.0)
    p = _progress(stage, 20, time.monotonic() + 3600)
    assert p.bar.n == 20
    p.step({})
    assert p.bar.n == 21 and p.bar.total == 50
    untimed = _progress(GRPOStage(max_steps=30), 7, None)
    untimed.step({})
    assert (untimed.bar.n, untimed.bar.total) == (8, 30)

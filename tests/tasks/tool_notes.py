"""A tool-use task with a side effect, for the preemption tests (issue #16): "note k"; the demonstration calls the
python tool twice with the same code (`NOTE`), which appends a line to the file `n` in the sample's work directory,
sleeps (so that a test can kill the job while a call runs) and prints the file; then it answers with the number of
lines the file held. A call that ran twice, or a work directory lost across a resume, shows in the outputs. Tests
name it as `tests.tasks.tool_notes:ToolNotes`."""

from __future__ import annotations

import random

from rewards import Problem, Task, Trajectory, Verdict, VerifyContext
from rollout.tool_calls import PLAIN_TOOL_CLOSE, PLAIN_TOOL_OPEN

NOTE = "import os;os.system('echo x>>n;sleep .4;cat n')"
"""The call's code, as the store keeps it (`Turn.call`)."""


class ToolNotes(Task):
    def __init__(self, name: str):
        self.name = name

    def problem_for(self, k: int) -> Problem:
        return Problem(f"{self.name}:{k}", self.name, f"note {k}\n", answer="2", metadata={"k": k})

    def train_stream(self, seed_offset: int = 0):
        rng = random.Random(seed_offset)
        while True:
            yield self.problem_for(rng.randint(10, 99))

    def heldout(self):
        return [self.problem_for(k) for k in (11, 22)]

    def demonstration(self, problem: Problem, rng: random.Random, **_) -> str:
        call = f"```python\n{NOTE}\n```"
        return f"{call}{PLAIN_TOOL_OPEN}x{PLAIN_TOOL_CLOSE}{call}{PLAIN_TOOL_OPEN}x\nx{PLAIN_TOOL_CLOSE}2"

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        correct = trajectory.response.strip() == "2"
        return Verdict(float(correct), correct, f"answered {trajectory.response.strip()[:12]!r}")

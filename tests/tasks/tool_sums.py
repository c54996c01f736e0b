"""A tool-use task for tests (issue #16): "sum a b"; the demonstration calls the python tool, reads its output
and answers with it, so a tiny char-level model learns in a few SFT steps to write a call the engine pauses at.
Correct when the final assistant turn is the sum. Tests name it as `tests.tasks.tool_sums:ToolSums`; with
`args: {hog: F}` that share of the demonstrations calls for 128 MiB instead (a call that a sandbox of 64 MiB has
killed for memory: the repercussion tests); the model learns both calls and samples either."""

from __future__ import annotations

import random

from rewards import Problem, Task, Trajectory, Verdict, VerifyContext
from rollout.tool_calls import PLAIN_TOOL_CLOSE, PLAIN_TOOL_OPEN


class ToolSums(Task):
    HOG = "```python\nb'x'*2**27\n```"

    def __init__(self, name: str, hog: float = 0.0):
        self.name, self.hog = name, float(hog)

    def problem_for(self, a: int, b: int) -> Problem:
        return Problem(f"{self.name}:{a}+{b}", self.name, f"sum {a} {b}\n", answer=str(a + b), metadata={"a": a, "b": b})

    def train_stream(self, seed_offset: int = 0):
        rng = random.Random(seed_offset)
        while True:
            yield self.problem_for(rng.randint(10, 99), rng.randint(10, 99))

    def heldout(self):
        return [self.problem_for(11 * k, 7 * k + 3) for k in range(1, 5)]

    def demonstration(self, problem: Problem, rng: random.Random, **_) -> str:
        a, b = problem.metadata["a"], problem.metadata["b"]
        if self.hog and rng.random() < self.hog:
            return self.HOG
        return f"```python\nprint({a}+{b})\n```{PLAIN_TOOL_OPEN}{a + b}{PLAIN_TOOL_CLOSE}{a + b}"

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        got = trajectory.response.strip()
        used_tool = any(t.role == "tool" for t in trajectory.turns)
        correct = got == trajectory.problem.answer
        return Verdict(float(correct), correct, f"answered {got[:12]!r}, {'with' if used_tool else 'without'} a tool call")

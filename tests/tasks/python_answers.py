"""A task whose verifier must run the answer (issue #16, item 3): the response is a Python program, scored by
what it prints, through the code runner rl/ hands verifiers (`VerifyContext.code`). Tests name it in recipes
as `type: custom, task: "tests.tasks.python_answers:PythonAnswers"`."""

from __future__ import annotations

import random

from rewards import Problem, Task, Trajectory, Verdict, VerifyContext


class PythonAnswers(Task):
    """"Print a + b" for small a, b; the response is a program whose output must be the sum."""

    def __init__(self, name: str):
        self.name = name

    def problem_for(self, a: int, b: int) -> Problem:
        return Problem(f"{self.name}:{a}+{b}", self.name, f"print {a}+{b}\n", answer=str(a + b))

    def train_stream(self, seed_offset: int = 0):
        rng = random.Random(seed_offset)
        while True:
            yield self.problem_for(rng.randint(0, 9), rng.randint(0, 9))

    def heldout(self):
        return [self.problem_for(a, 9 - a) for a in range(4)]

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        if ctx.code is None:
            return Verdict(0.0, False, "no code runner (recipe sandbox.socket)")
        r = ctx.code.run(trajectory.response, timeout_s=5)
        if r.exit_code is None:
            return Verdict(0.0, False, f"killed: {r.stderr.strip().splitlines()[-1]}")
        correct = r.exit_code == 0 and r.stdout.strip() == trajectory.problem.answer
        return Verdict(1.0 if correct else 0.0, correct, f"printed {r.stdout.strip()[:20]!r}, exit {r.exit_code}")

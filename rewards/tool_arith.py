"""Tool-use arithmetic (issue #16, part 5): products of multi-digit numbers, too large for a small model to work
out in its scratchpad, but exact for one that calls the Python tool and copies what it prints.

A problem's prompt is "a*b=\\n"; the answer is the product. Demonstrations (the SFT warm start) come in two forms:
- `use_tool: true`: a fenced call, the tool's output as the worker appends it, then the answer:
      ```python
      print(a*b)
      ```<OPEN>a·b<CLOSE>a·b
  where OPEN/CLOSE are how the worker wraps a tool's output for a tokenizer without a chat template
  (rollout/tool_calls.PLAIN_TOOL_OPEN/CLOSE; a test checks they agree: rewards/ imports nothing of rollout/);
- `use_tool: false`: the answer alone.
With probability `slip_rate` a demonstration slips, systematically as the quickstart's do (a slip rate above 0.5
makes the slip what SFT's greedy policy learns, and leaves GRPO the correct copy to find by sampling): the call
copies the first operand with its last two digits swapped (when they differ; the output and the answer follow the
wrong call), or the direct answer has its last two digits swapped. A response is correct when its last assistant
turn is exactly the product.
"""

from __future__ import annotations

import random

from rewards.task import Problem, Task, Trajectory, Verdict, VerifyContext

TOOL_OUTPUT_OPEN, TOOL_OUTPUT_CLOSE = "\n<tool_output>\n", "\n</tool_output>\n"
"""The plain wrapper of a tool's output (must equal rollout/tool_calls.PLAIN_TOOL_OPEN / PLAIN_TOOL_CLOSE)."""


class ToolArith(Task):
    def __init__(self, name: str, *, digits: int = 3, use_tool: bool = True, slip_rate: float = 0.3,
                 num_heldout: int = 128, seed: int = 0):
        if digits < 1 or not 0.0 <= slip_rate <= 1.0:
            raise ValueError(f"tool_arith: digits must be >= 1 and slip_rate in [0, 1], got {digits}, {slip_rate}")
        self.name, self.digits, self.use_tool, self.slip_rate = name, digits, use_tool, slip_rate
        self.num_heldout, self.seed = num_heldout, seed

    def _problem(self, a: int, b: int) -> Problem:
        return Problem(f"{self.name}:{a}*{b}", self.name, f"{a}*{b}=\n", answer=str(a * b), metadata={"a": a, "b": b})

    def _draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits - 1
        return self._problem(rng.randint(lo, hi), rng.randint(lo, hi))

    def heldout(self) -> list[Problem]:
        rng = random.Random(f"{self.seed}:heldout")
        return [self._draw(rng) for _ in range(self.num_heldout)]

    def train_stream(self, seed_offset: int = 0):
        held = {p.problem_id for p in self.heldout()}
        rng = random.Random(f"{self.seed}:train:{seed_offset}")
        while True:
            p = self._draw(rng)
            if p.problem_id not in held:
                yield p

    def demonstration(self, problem: Problem, rng: random.Random, **_) -> str:
        a, b = problem.metadata["a"], problem.metadata["b"]
        slip = rng.random() < self.slip_rate
        if not self.use_tool:
            return _swap_last_two(str(a * b)) if slip else str(a * b)
        if slip:  # the first operand copied with its last two digits swapped; the output and the answer follow it
            a = int(_swap_last_two(str(a)))
        return f"```python\nprint({a}*{b})\n```{TOOL_OUTPUT_OPEN}{a * b}{TOOL_OUTPUT_CLOSE}{a * b}"

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        got = trajectory.response.strip()
        tool = any(t.role == "tool" for t in trajectory.turns)
        correct = got == trajectory.problem.answer
        return Verdict(float(correct), correct, f"answered {got[:16]!r} {'after a tool call' if tool else 'without a tool'}",
                       answered=got.isdigit())


def _swap_last_two(s: str) -> str:
    return s[:-2] + s[-1] + s[-2] if len(s) >= 2 else s

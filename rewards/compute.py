"""Problems that need computation (issue #43, domain b): the policy writes Python, the sandbox runs it, and the
policy answers from what it printed (seed §5.1.3's agentic rollouts, with the recipe's `tools` and `sandbox`).

Each kind is a sub-dataset, and none can be done reliably in a small model's head: products and sums of
multi-digit numbers, an expression of several of them, a power modulo a number, the digit sum of a large power,
reversing a random string, counting a letter or the vowels of a long one, sorting a list of numbers. The prompt is
chat messages: a system message that asks for the answer in a fixed form, and the question. With the recipe's
`tools` the renderer adds the tool declaration to the system message; without (the no-tool control,
`use_tool: false`) the prompt is the same and the model must answer from its head.

Demonstrations (SFT warm start): with `use_tool` the turns a rollout would hold, a fenced call that prints the
answer, the tool's output, the answer line (rl/algo/sft.py tokenises the output as the worker appends it, untrained);
without, the answer line alone. Verdict: the last "The answer is X" of the last assistant turn, compared with the
reference (numbers as integers, "1,234" read as 1234; strings exactly, surrounding quotes and a final period dropped).
The held-out split is a fixed 1-in-10 hash of the question, shared by every dataset of the domain.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

from rewards.procedural import DrawnTask, stable_int
from rewards.task import Message, Problem, Trajectory, Turn, Verdict, VerifyContext

SYSTEM = "Answer the question. End your reply with: The answer is X."
ANSWER = re.compile(r"the answer is\s*:?\s*(.+?)\s*$", re.I | re.M)


@dataclass(frozen=True)
class Kind:
    """A sort of question: (question, the Python that prints its answer, the answer) from a random draw; `numeric`:
    the answer is an integer (compared as one)."""

    make: Callable[[random.Random], tuple[str, str, str]]
    numeric: bool = True


def _n(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (d - 1), 10 ** d - 1)


def _multiply(rng):
    a, b = _n(rng, 3, 4), _n(rng, 3, 4)
    return f"What is {a} * {b}?", f"print({a} * {b})", str(a * b)


def _expression(rng):
    a, b, c, d, e = _n(rng, 2, 3), _n(rng, 2, 3), _n(rng, 3, 4), _n(rng, 2, 2), _n(rng, 2, 2)
    expr = f"{a} * {b} - {c} + {d} * {e}"
    return f"What is {expr}?", f"print({expr})", str(a * b - c + d * e)


def _sum_list(rng):
    xs = [_n(rng, 2, 4) for _ in range(rng.randint(6, 9))]
    listed = ", ".join(map(str, xs[:-1])) + f" and {xs[-1]}"
    return f"What is the sum of {listed}?", f"print(sum([{', '.join(map(str, xs))}]))", str(sum(xs))


def _power_mod(rng):
    a, k, m = rng.randint(3, 99), rng.randint(7, 40), rng.choice((97, 100, 101, 997, 1000, 1009))
    return f"What is {a} to the power {k}, modulo {m}?", f"print(pow({a}, {k}, {m}))", str(pow(a, k, m))


def _digit_sum(rng):
    a, k = rng.randint(2, 99), rng.randint(20, 80)
    return (f"What is the sum of the digits of {a} to the power {k}?", f"print(sum(int(c) for c in str({a} ** {k})))",
            str(sum(int(c) for c in str(a**k))))


def _word(rng, lo: int, hi: int, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _reverse(rng):
    w = _word(rng, 12, 20)
    return f"Reverse the string {w}.", f"print('{w}'[::-1])", w[::-1]


def _count_letter(rng):
    w = _word(rng, 30, 45, "abcdefgh")
    c = rng.choice("abcdefgh")
    return f"How many times does the letter {c} appear in {w}?", f"print('{w}'.count('{c}'))", str(w.count(c))


def _vowels(rng):
    w = _word(rng, 25, 40)
    return f"How many vowels (a, e, i, o, u) are in {w}?", f"print(sum(c in 'aeiou' for c in '{w}'))", \
        str(sum(c in "aeiou" for c in w))


def _sort(rng):
    xs = rng.sample(range(10, 1000), rng.randint(7, 10))
    listed = ", ".join(map(str, xs))
    return (f"Sort these numbers from smallest to largest: {listed}.",
            f"print(', '.join(str(x) for x in sorted([{listed}])))", ", ".join(map(str, sorted(xs))))


KINDS: dict[str, Kind] = {
    "multiply": Kind(_multiply), "expression": Kind(_expression), "sum_list": Kind(_sum_list),
    "power_mod": Kind(_power_mod), "digit_sum": Kind(_digit_sum), "reverse": Kind(_reverse, numeric=False),
    "count_letter": Kind(_count_letter), "vowels": Kind(_vowels), "sort": Kind(_sort, numeric=False),
}
"""The domain's kinds (sub-datasets)."""


def read_answer(response: str) -> str | None:
    """X of the reply's last "The answer is X" line, without surrounding quotes, asterisks or a final period; None
    when there is none."""
    found = ANSWER.findall(response)
    if not found:
        return None
    x = found[-1].strip()
    x = x[:-1] if x.endswith(".") else x
    return x.strip().strip("*`'\"").strip()


def same_answer(got: str, expected: str, numeric: bool) -> bool:
    if not numeric:
        return got == expected
    try:
        return int(got.replace(",", "").replace(" ", "")) == int(expected)
    except ValueError:
        return False


class ComputeTask(DrawnTask):
    """Questions of the given kinds (each problem's kind drawn uniformly); `use_tool`: demonstrations call Python."""

    family = "compute"

    def __init__(self, name: str, *, kinds: list[str] | None = None, use_tool: bool = True, num_heldout: int = 1000,
                 seed: int = 0):
        kinds = list(kinds or KINDS)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"compute: unknown kinds {unknown}; known: {', '.join(KINDS)}")
        if num_heldout < 1:
            raise ValueError(f"compute: num_heldout must be >= 1, got {num_heldout}")
        self.name, self.kinds, self.use_tool, self.num_heldout, self.seed = name, kinds, use_tool, num_heldout, seed
        self._heldout: list[Problem] | None = None

    def _draw(self, rng: random.Random) -> Problem:
        kind = rng.choice(self.kinds)
        question, code, answer = KINDS[kind].make(rng)
        return Problem(f"{self.name}:{kind}:{stable_int(question) % 10**12:012d}", self.name,
                       (Message("system", SYSTEM), Message("user", question)), answer=answer,
                       metadata={"kind": kind, "question": question, "code": code})

    def _split_key(self, problem: Problem) -> str:
        return problem.metadata["question"]

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        p = trajectory.problem
        tool = "after a tool call" if any(t.role == "tool" for t in trajectory.turns) else "without a tool"
        got = read_answer(trajectory.response)
        if got is None:
            return Verdict(0.0, False, f"no 'The answer is' line ({tool})", answered=False)
        correct = same_answer(got, p.answer, KINDS[p.metadata["kind"]].numeric)
        return Verdict(float(correct), correct, f"answered {got[:24]!r}, expected {p.answer[:24]!r} ({tool})",
                       answered=True)

    def demonstration(self, problem: Problem, rng: random.Random, **_) -> str | tuple[Turn, ...]:
        answer = f"The answer is {problem.answer}."
        if not self.use_tool:
            return answer
        return (Turn("assistant", f"```python\n{problem.metadata['code']}\n```"), Turn("tool", problem.answer),
                Turn("assistant", answer))

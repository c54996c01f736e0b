"""Procedural multi-digit addition with a worked, column-by-column scratchpad (pure Python).

Format. The prompt is "a+b=" (the driver adds BOS). The response works one column per line from the
least significant, padding the shorter operand with an explicit 0 and showing the carry-in only when
it is 1: "{da}+{db}={s}" or "{da}+{db}+1={s}", where s is the full column sum. A last line holds the
answer: the final carry (when the last s >= 10) then the last digit of every s, most significant
first, so the answer always agrees with the lines as written. No trailing newline (the driver appends
EOS). 372+589:

    2+9=11
    7+8+1=16
    3+5+1=9
    961

Slip model. A *cascading* column has carry-in 1 and digits summing to exactly 9 ("4+5+1=10"). SFT
demonstrations (`ArithmeticTask.demonstration`) slip in each cascading column with probability
`slip_rate`: they write "4+5+1=9", drop the carry-out, and continue consistently, so the answer line
is the wrong one those lines imply. It exists because real demonstrations contain slips, and it makes
the gap between imitation and verification measurable: both variants share the prefix "4+5+1=", so
the slip is a single next-character choice ("9" vs "1"). SFT fits the demonstrators' distribution at
that choice; once slip_rate > 0.5 its greedy mode is the slip, so greedy decoding fails every problem
with a cascading column, and more SFT only sharpens that estimate (a plateau). The verifier scores
against a+b, not against the demonstrations, so verifier-driven RL can move the mass to the carry.

Splits (rewards/procedural.py): a pair (a, b) is held out iff blake2b(f"{a}+{b}") % 10 == 0, a fixed 10%
(ordered: (a, b) and (b, a) are separate). `Problem.metadata` holds the operands and the clean solution.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

from pydantic import Field, model_validator

from configbase import StrictConfig
from rewards.procedural import ProceduralTask, last_line_verdict
from rewards.task import Problem, Trajectory, Verdict, VerifyContext


class ArithmeticConfig(StrictConfig):
    """Procedural multi-digit addition with a column-by-column scratchpad (the task below)."""

    type: Literal["arithmetic"] = "arithmetic"
    """Discriminator: the procedural addition task family."""
    name: str = Field("arith", min_length=1)
    """Dataset name; it prefixes every problem_id and tags samples and metrics."""
    min_digits: int = Field(1, ge=1)
    """Fewest decimal digits of an operand (each operand's length is drawn uniformly, independently)."""
    max_digits: int = Field(6, ge=1, le=18)
    """Most decimal digits of an operand; 18 keeps a+b well inside int64 for any consumer that needs it."""
    pair_nine_prob: float = Field(0.3, ge=0.0, le=1.0)
    """Probability that a column where both operands have a digit is forced to sum to 9, making cascading
    carries (the columns demonstrators slip on) common; with uniform digits they are rare."""
    slip_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability, per cascading column, that an SFT demonstration drops the carry ("4+5+1=9");
    never applies to the clean solution or to the verifier."""
    direct_answer_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of SFT demonstrations that skip the scratchpad and write only the answer line, so the
    policy can trade length for accuracy (effort conditioning needs that choice to exist)."""
    seed: int = 0
    """Seed of the train stream and of the held-out set; same seed, same problems."""
    num_heldout: int = Field(256, gt=0)
    """Size of the fixed held-out set (distinct (a, b) pairs never seen by the train stream)."""

    @model_validator(mode="after")
    def _digit_range(self) -> "ArithmeticConfig":
        if self.max_digits < self.min_digits:
            raise ValueError(f"max_digits={self.max_digits} is smaller than min_digits={self.min_digits}")
        return self

    def build(self) -> "ArithmeticTask":
        return ArithmeticTask(self)


def worked_solution(a: int, b: int, slip: Callable[[int], bool] | None = None) -> str:
    """Worked solution of a+b. `slip(column_index)` is asked once per cascading column (index 0 is the
    least significant); when it returns True that column is written without its carry ("4+5+1=9") and
    the following columns continue from the written sum. slip=None gives the clean solution."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got a={a} b={b}")
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    lines: list[str] = []
    sums: list[int] = []
    carry = 0
    for i in range(max(len(digits_a), len(digits_b))):
        da = int(digits_a[i]) if i < len(digits_a) else 0
        db = int(digits_b[i]) if i < len(digits_b) else 0
        cascading = carry == 1 and da + db == 9
        s = 9 if cascading and slip is not None and slip(i) else da + db + carry
        lines.append(f"{da}+{db}+1={s}" if carry else f"{da}+{db}={s}")
        sums.append(s)
        carry = s // 10
    answer = ("1" if carry else "") + "".join(str(s % 10) for s in reversed(sums))
    return "\n".join([*lines, answer])


class ArithmeticTask(ProceduralTask):
    """Problem source, demonstrator and verifier of the addition task family."""

    kind = "arithmetic"
    stream_salt = ""  # the streams of the first addition task, kept so its problems stay the same

    cfg: ArithmeticConfig

    def draw(self, rng: random.Random) -> tuple[int, int]:
        cfg = self.cfg
        len_a = rng.randint(cfg.min_digits, cfg.max_digits)
        len_b = rng.randint(cfg.min_digits, cfg.max_digits)
        # Digits least significant first; a leading digit is nonzero unless the number is one digit.
        digits_a = [rng.randint(1 if i == len_a - 1 and len_a > 1 else 0, 9) for i in range(len_a)]
        digits_b: list[int] = []
        for i in range(len_b):
            leading = i == len_b - 1 and len_b > 1
            if i < len_a and rng.random() < cfg.pair_nine_prob:
                d = 9 - digits_a[i]
                if leading and d == 0:  # a 9 above b's leading digit cannot be paired: redraw nonzero
                    d = rng.randint(1, 9)
            else:
                d = rng.randint(1 if leading else 0, 9)
            digits_b.append(d)
        a = int("".join(map(str, reversed(digits_a))))
        b = int("".join(map(str, reversed(digits_b))))
        return a, b

    def render(self, instance: tuple[int, int]) -> tuple[str, list[str], str, dict]:
        a, b = instance
        *lines, answer = worked_solution(a, b).split("\n")
        return f"{a}+{b}=", lines, answer, {"a": a, "b": b}

    def split_key(self, problem: Problem) -> str:
        return f"{problem.metadata['a']}+{problem.metadata['b']}"

    def worked_demonstration(self, problem: Problem, rng: random.Random) -> str:
        """The worked solution with a slip in each cascading column at cfg.slip_rate."""
        rate = self.cfg.slip_rate
        slip = (lambda _column: rng.random() < rate) if rate > 0 else None
        return worked_solution(problem.metadata["a"], problem.metadata["b"], slip)

    def verify(self, trajectory: Trajectory, ctx: VerifyContext | None = None) -> Verdict:
        """Reward 1 iff the response's last non-blank line is exactly the sum; never raises."""
        return last_line_verdict(trajectory.response, trajectory.problem.answer, numeric=True)

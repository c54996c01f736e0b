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

Splits. A pair (a, b) is held out iff blake2b(f"{a}+{b}") % 10 == 0 (a fixed 10%). The train stream
rejects held-out pairs and the held-out set draws only them, so the two never share a pair, whatever
the seeds. Both are `random.Random` streams seeded from the config: same seed, same problems.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rewards.config import ArithmeticConfig

HELDOUT_MODULUS = 10
"""A pair is held out iff its hash is 0 modulo this: a fixed 10% of all pairs."""
_MAX_DRAWS_PER_HELDOUT = 1000
"""Held-out draws give up after this many attempts per wanted problem (a too-small pair space)."""


@dataclass(frozen=True)
class Problem:
    problem_id: str
    """f"{dataset}:{a}+{b}"; unique per pair within a dataset."""
    dataset: str
    a: int
    b: int
    prompt: str
    """"a+b=", exactly as tokenised after BOS."""
    answer: str
    """str(a + b), what the verifier compares against."""
    solution: str
    """Clean worked solution: the response text a perfect policy writes."""
    forced_length: int | None = None
    """System benchmarks only (rewards/longtail.py): responses end at a forced length (see
    `response_budget`) instead of at EOS."""


@dataclass(frozen=True)
class Verdict:
    reward: float
    correct: bool
    parsed: str | None
    """The answer read from the response's last line; None when that line is not a number."""


def _stable_int(text: str) -> int:
    # Python's hash() is salted per process; splits and seeds must survive restarts.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def is_heldout(a: int, b: int) -> bool:
    """Split rule: the pair belongs to the held-out set (ordered: (a, b) and (b, a) are separate)."""
    return _stable_int(f"{a}+{b}") % HELDOUT_MODULUS == 0


def partial_scratchpad(worked: str, reasoning_frac: float) -> str:
    """The first round-half-up(reasoning_frac · n) of a worked solution's n lines, then its answer line."""
    *lines, answer = worked.split("\n")
    keep = min(len(lines), math.floor(reasoning_frac * len(lines) + 0.5))
    return "\n".join([*lines[:keep], answer])


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


class ArithmeticTask:
    """Problem source, demonstrator and verifier of the addition task family."""

    def __init__(self, cfg: ArithmeticConfig):
        self.cfg = cfg
        self._heldout: list[Problem] | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    def make_problem(self, a: int, b: int) -> Problem:
        return Problem(
            problem_id=f"{self.cfg.name}:{a}+{b}",
            dataset=self.cfg.name,
            a=a,
            b=b,
            prompt=f"{a}+{b}=",
            answer=str(a + b),
            solution=worked_solution(a, b),
        )

    def _draw_pair(self, rng: random.Random) -> tuple[int, int]:
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

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        """Infinite train problems (repeats possible, held-out pairs never); reproducible per
        (cfg.seed, seed_offset), and distinct offsets give distinct streams (e.g. one per worker)."""
        rng = random.Random(_stable_int(f"train:{self.cfg.seed}:{seed_offset}"))
        while True:
            a, b = self._draw_pair(rng)
            if not is_heldout(a, b):
                yield self.make_problem(a, b)

    def heldout(self) -> list[Problem]:
        """cfg.num_heldout distinct held-out problems, fixed given cfg.seed, in draw order."""
        if self._heldout is None:
            cfg = self.cfg
            rng = random.Random(_stable_int(f"heldout:{cfg.seed}"))
            seen: set[tuple[int, int]] = set()
            problems: list[Problem] = []
            for _ in range(_MAX_DRAWS_PER_HELDOUT * cfg.num_heldout):
                a, b = self._draw_pair(rng)
                if (a, b) in seen or not is_heldout(a, b):
                    continue
                seen.add((a, b))
                problems.append(self.make_problem(a, b))
                if len(problems) == cfg.num_heldout:
                    break
            else:
                raise ValueError(
                    f"found only {len(problems)} distinct held-out pairs of num_heldout={cfg.num_heldout} "
                    f"with min_digits={cfg.min_digits} max_digits={cfg.max_digits} "
                    f"pair_nine_prob={cfg.pair_nine_prob}: the pair space is too small; lower num_heldout"
                )
            self._heldout = problems
        return list(self._heldout)

    @staticmethod
    def reasoning_tokens(response: str) -> int:
        """ℓ for the length penalty: the scratchpad, i.e. every character (= char token) before the
        final answer line, newlines included; a direct answer has ℓ = 0."""
        cut = response.rstrip().rfind("\n")
        return max(cut, 0) + (1 if cut >= 0 else 0)

    def response_budget(self, problem: Problem, j: int) -> int | None:
        """Forced response length of sample j, for forced-length tasks; None: stop at EOS."""
        return None

    def demonstration(self, problem: Problem, rng: random.Random, direct_answer_rate: float | None = None,
                      reasoning_frac: float | None = None) -> str:
        """SFT target: the worked solution with a slip in each cascading column at cfg.slip_rate; with
        probability direct_answer_rate (default cfg.direct_answer_rate) only the answer line.
        reasoning_frac: keep only that share of the worked lines (rounded half up; the least
        significant columns, whose carries the rest depend on), then the answer line: a partial
        scratchpad whose length grows with the share (the graded effort cold start)."""
        rate = self.cfg.slip_rate
        slip = (lambda _column: rng.random() < rate) if rate > 0 else None
        worked = worked_solution(problem.a, problem.b, slip)
        if reasoning_frac is not None:
            return partial_scratchpad(worked, reasoning_frac)
        direct = self.cfg.direct_answer_rate if direct_answer_rate is None else direct_answer_rate
        if direct and rng.random() < direct:
            return worked.rsplit("\n", 1)[-1]  # the answer line alone (slips included)
        return worked

    def verify(self, problem: Problem, response: str) -> Verdict:
        """Reward 1 iff the response's last non-blank line is exactly the sum; never raises."""
        text = response.strip() if isinstance(response, str) else ""
        if not text:
            return Verdict(reward=0.0, correct=False, parsed=None)
        last = text.splitlines()[-1].strip()
        if not (last.isascii() and last.isdigit()):
            return Verdict(reward=0.0, correct=False, parsed=None)
        correct = last == problem.answer
        return Verdict(reward=1.0 if correct else 0.0, correct=correct, parsed=last)

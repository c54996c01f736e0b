"""Procedural task domains besides addition: generators, worked demonstrations and verifiers (pure Python).

Each domain is a small task family with the interface of `rewards.arithmetic.ArithmeticTask` (the
driver's task seam): `name`, `train_stream(seed_offset)`, `heldout()`, `verify(problem, response)`,
`demonstration(problem, rng)`, `reasoning_tokens(response)`, `response_budget(problem, j)`, and the
same `Problem` / `Verdict` records. They exist so that OPD has many domains, each served by its own
teacher (seed §5.2.4), while every one stays learnable by a tiny char-level model on CPU: the prompt
and the worked solution together fit in ~60 characters of printable ASCII.

Format shared by all domains. The prompt names the domain and ends with "=" (the driver adds BOS);
the response is zero or more worked lines, then one answer line, no trailing newline (the driver
appends EOS). The verifier compares the last non-blank line of a response with the answer, exactly.

    domain           prompt             worked solution (lines joined by newlines)
    reverse          rev abc=           cba
    uppercase        up abc=            ABC
    sort_digits      sort 5391=         1359
    count_char       cnt a:abca=        1112 / 2             (running count after each character)
    subtraction      523-187=           3-7=6b / 2-8-1=3b / 5-1-1=3 / 336   (b: borrow from the next column)
    multiply_digit   47*6=              7*6=42 / 4*6+4=28 / 282             (+c: carry in)
    modulo           123%7=             1%7=1 / 12%7=5 / 53%7=4 / 4        (running remainder)
    max_list         max 37,92,41=      37 92 92 / 92        (running maximum)
    base_conversion  13>b2=             13:1 / 6:0 / 3:1 / 1:1 / 1101      (n : n mod k, then n // k)
    digit_sum        dsum 4721=         4 11 13 14 / 14      (running sum)

Splits. An instance is held out iff blake2b(f"{type}:{prompt}") % 10 == 0: the prompt determines the
instance, so the rule is per domain type (datasets of one type with different names or seeds share it)
and the train stream, which rejects held-out instances, never meets one. `Problem.a` and `Problem.b`
carry the domain's integer operands where it has them (subtraction, multiplication, modulo, base
conversion: a and b; others: a = input length, b = 0); nothing downstream reads them.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from typing import Any, ClassVar

from rewards.arithmetic import ArithmeticTask, Problem, Verdict, _stable_int, partial_scratchpad
from rewards.config import (
    BaseConversionConfig,
    CountCharConfig,
    DigitSumConfig,
    MaxListConfig,
    ModuloConfig,
    MultiplyDigitConfig,
    ReverseConfig,
    SortDigitsConfig,
    SubtractionConfig,
    UppercaseConfig,
)
from rewards.longtail import LongTailTask

HELDOUT_MODULUS = 10
"""An instance is held out iff its hash is 0 modulo this: a fixed 10% of every domain."""
_MAX_DRAWS_PER_HELDOUT = 1000
"""Held-out draws give up after this many attempts per wanted problem (a too-small instance space)."""


def is_heldout(kind: str, prompt: str) -> bool:
    """Split rule of every procedural domain: the instance whose prompt this is belongs to the held-out set."""
    return _stable_int(f"{kind}:{prompt}") % HELDOUT_MODULUS == 0


class ProceduralTask:
    """Shared generator / split / verifier machinery; a domain supplies `draw` and `render`.

    `draw(rng)` returns an instance (any hashable value); `render(instance)` returns
    (prompt, worked lines, answer, (a, b)). Everything else (splits, streams, verification,
    demonstrations, ℓ for the length penalty) is the same for every domain."""

    kind: ClassVar[str]
    """The config's `type` discriminator; it salts the split hash and the streams."""

    def __init__(self, cfg: Any):
        if cfg.type != self.kind:
            raise ValueError(f"{type(self).__name__} builds `type: {self.kind}` datasets, got `type: {cfg.type}`")
        self.cfg = cfg
        self._heldout: list[Problem] | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    # -- what a domain defines --------------------------------------------------------------------
    def draw(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def render(self, instance: Any) -> tuple[str, list[str], str, tuple[int, int]]:
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------------
    def make_problem(self, instance: Any) -> Problem:
        prompt, lines, answer, (a, b) = self.render(instance)
        return Problem(
            problem_id=f"{self.cfg.name}:{prompt[:-1]}",
            dataset=self.cfg.name,
            a=a,
            b=b,
            prompt=prompt,
            answer=answer,
            solution="\n".join([*lines, answer]),
        )

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        """Infinite train problems (repeats possible, held-out instances never); reproducible per
        (cfg.seed, seed_offset), and distinct offsets give distinct streams."""
        rng = random.Random(_stable_int(f"train:{self.kind}:{self.cfg.seed}:{seed_offset}"))
        while True:
            problem = self.make_problem(self.draw(rng))
            if not is_heldout(self.kind, problem.prompt):
                yield problem

    def heldout(self) -> list[Problem]:
        """cfg.num_heldout distinct held-out problems, fixed given cfg.seed, in draw order."""
        if self._heldout is None:
            cfg = self.cfg
            rng = random.Random(_stable_int(f"heldout:{self.kind}:{cfg.seed}"))
            seen: set[str] = set()
            problems: list[Problem] = []
            for _ in range(_MAX_DRAWS_PER_HELDOUT * cfg.num_heldout):
                problem = self.make_problem(self.draw(rng))
                if problem.prompt in seen or not is_heldout(self.kind, problem.prompt):
                    continue
                seen.add(problem.prompt)
                problems.append(problem)
                if len(problems) == cfg.num_heldout:
                    break
            else:
                raise ValueError(
                    f"dataset {cfg.name!r} (type {self.kind}) found only {len(problems)} distinct held-out "
                    f"instances of num_heldout={cfg.num_heldout}: the instance space is too small; lower num_heldout"
                )
            self._heldout = problems
        return list(self._heldout)

    reasoning_tokens = staticmethod(ArithmeticTask.reasoning_tokens)
    """ℓ for the length penalty: every character before the answer line (newlines included)."""

    def response_budget(self, problem: Problem, j: int) -> int | None:
        """Procedural domains stop at EOS: no forced length."""
        return None

    def demonstration(self, problem: Problem, rng: random.Random, direct_answer_rate: float | None = None,
                      reasoning_frac: float | None = None) -> str:
        """SFT target: the worked solution; with probability direct_answer_rate (default
        cfg.direct_answer_rate) the answer line alone; reasoning_frac keeps that share of the worked
        lines (rewards.arithmetic.partial_scratchpad)."""
        if reasoning_frac is not None:
            return partial_scratchpad(problem.solution, reasoning_frac)
        direct = self.cfg.direct_answer_rate if direct_answer_rate is None else direct_answer_rate
        if direct and rng.random() < direct:
            return problem.answer
        return problem.solution

    def verify(self, problem: Problem, response: str) -> Verdict:
        """Reward 1 iff the response's last non-blank line is exactly the answer; never raises."""
        text = response.strip() if isinstance(response, str) else ""
        if not text:
            return Verdict(reward=0.0, correct=False, parsed=None)
        last = text.splitlines()[-1].strip()
        correct = last == problem.answer
        return Verdict(reward=1.0 if correct else 0.0, correct=correct, parsed=last)


def _lowercase(rng: random.Random, cfg: Any, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(cfg.min_len, cfg.max_len)))


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """Uniform digit count, then uniform over the numbers with that many digits (0 counts as one digit)."""
    n = rng.randint(min_digits, max_digits)
    return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)


class ReverseTask(ProceduralTask):
    kind = "reverse"

    def draw(self, rng):
        return _lowercase(rng, self.cfg)

    def render(self, s):
        return f"rev {s}=", [], s[::-1], (len(s), 0)


class UppercaseTask(ProceduralTask):
    kind = "uppercase"

    def draw(self, rng):
        return _lowercase(rng, self.cfg)

    def render(self, s):
        return f"up {s}=", [], s.upper(), (len(s), 0)


class SortDigitsTask(ProceduralTask):
    kind = "sort_digits"

    def draw(self, rng):
        return _lowercase(rng, self.cfg, string.digits)

    def render(self, s):
        return f"sort {s}=", [], "".join(sorted(s)), (len(s), 0)


class CountCharTask(ProceduralTask):
    kind = "count_char"

    def draw(self, rng):
        return rng.choice(self.cfg.alphabet), _lowercase(rng, self.cfg, self.cfg.alphabet)

    def render(self, inst):
        c, s = inst
        running, n = [], 0
        for ch in s:
            n += ch == c
            running.append(str(n))
        return f"cnt {c}:{s}=", ["".join(running)], str(n), (len(s), 0)


def subtraction_lines(a: int, b: int) -> list[str]:
    """Column lines of a - b (a >= b), least significant first: "{da}-{db}[-1]={r}" with the column
    result r = da - db - borrow_in; a negative r is written as r + 10 followed by "b" (borrow)."""
    if not 0 <= b <= a:
        raise ValueError(f"subtraction needs 0 <= b <= a, got a={a} b={b}")
    da_s, db_s = str(a)[::-1], str(b)[::-1]
    lines, borrow = [], 0
    for i, ch in enumerate(da_s):
        da, db = int(ch), int(db_s[i]) if i < len(db_s) else 0
        r = da - db - borrow
        lhs = f"{da}-{db}-1" if borrow else f"{da}-{db}"
        borrow = int(r < 0)
        lines.append(f"{lhs}={r + 10}b" if borrow else f"{lhs}={r}")
    return lines


class SubtractionTask(ProceduralTask):
    kind = "subtraction"

    def draw(self, rng):
        a = _number(rng, self.cfg.min_digits, self.cfg.max_digits)
        return a, rng.randint(0, a)

    def render(self, inst):
        a, b = inst
        return f"{a}-{b}=", subtraction_lines(a, b), str(a - b), (a, b)


def multiply_lines(a: int, d: int) -> list[str]:
    """Column lines of a * d, least significant first: "{da}*{d}={p}" or "{da}*{d}+{carry}={p}"."""
    lines, carry = [], 0
    for ch in str(a)[::-1]:
        p = int(ch) * d + carry
        lines.append(f"{ch}*{d}+{carry}={p}" if carry else f"{ch}*{d}={p}")
        carry = p // 10
    return lines


class MultiplyDigitTask(ProceduralTask):
    kind = "multiply_digit"

    def draw(self, rng):
        return _number(rng, self.cfg.min_digits, self.cfg.max_digits), rng.randint(0, 9)

    def render(self, inst):
        a, d = inst
        return f"{a}*{d}=", multiply_lines(a, d), str(a * d), (a, d)


class ModuloTask(ProceduralTask):
    kind = "modulo"

    def draw(self, rng):
        return _number(rng, self.cfg.min_digits, self.cfg.max_digits), rng.choice(self.cfg.moduli)

    def render(self, inst):
        n, m = inst
        lines, r = [], 0
        for ch in str(n):
            x = 10 * r + int(ch)
            r = x % m
            lines.append(f"{x}%{m}={r}")
        return f"{n}%{m}=", lines, str(n % m), (n, m)


class MaxListTask(ProceduralTask):
    kind = "max_list"

    def draw(self, rng):
        return tuple(rng.randint(10, 99) for _ in range(rng.randint(self.cfg.min_items, self.cfg.max_items)))

    def render(self, xs):
        running, best = [], xs[0]
        for x in xs:
            best = max(best, x)
            running.append(str(best))
        return f"max {','.join(map(str, xs))}=", [" ".join(running)], str(best), (len(xs), 0)


class BaseConversionTask(ProceduralTask):
    kind = "base_conversion"

    def draw(self, rng):
        return rng.randint(0, self.cfg.max_value), rng.choice(self.cfg.bases)

    def render(self, inst):
        n, k = inst
        lines, digits, x = [], [], n
        while x:
            lines.append(f"{x}:{x % k}")
            digits.append(str(x % k))
            x //= k
        return f"{n}>b{k}=", lines, "".join(reversed(digits)) or "0", (n, k)


class DigitSumTask(ProceduralTask):
    kind = "digit_sum"

    def draw(self, rng):
        return _number(rng, self.cfg.min_digits, self.cfg.max_digits)

    def render(self, n):
        running, total = [], 0
        for ch in str(n):
            total += int(ch)
            running.append(str(total))
        return f"dsum {n}=", [" ".join(running)], str(total), (len(str(n)), 0)


DOMAIN_CLASSES: dict[str, type[ProceduralTask]] = {
    cls.kind: cls
    for cls in (ReverseTask, UppercaseTask, SortDigitsTask, CountCharTask, SubtractionTask, MultiplyDigitTask,
                ModuloTask, MaxListTask, BaseConversionTask, DigitSumTask)
}
"""The procedural domains besides addition, by config `type`."""

TASK_CLASSES: dict[str, type] = {"arithmetic": ArithmeticTask, "longtail": LongTailTask, **DOMAIN_CLASSES}
"""Every task family, by config `type`: what `build_task` dispatches on."""

DEFAULT_DOMAIN_CONFIGS = (
    ReverseConfig(), UppercaseConfig(), SortDigitsConfig(), CountCharConfig(), SubtractionConfig(),
    MultiplyDigitConfig(), ModuloConfig(), MaxListConfig(), BaseConversionConfig(), DigitSumConfig(),
)
"""One default-configured dataset per procedural domain (unique names), e.g. for a teacher per domain."""


def build_task(cfg: Any):
    """The task a dataset config describes (the registry lookup behind every `cfg.build()`)."""
    try:
        cls = TASK_CLASSES[cfg.type]
    except KeyError:
        raise ValueError(f"unknown task type {cfg.type!r}; known: {sorted(TASK_CLASSES)}") from None
    return cls(cfg)

"""Procedural task domains besides addition: generators, worked demonstrations and verifiers (pure Python).

Each domain is a small `rewards.procedural.ProceduralTask` (the `rewards.task.Task` seam). They exist so
that OPD has many domains, each served by its own teacher (seed §5.2.4), while every one stays
learnable by a tiny char-level model on CPU: the prompt and the worked solution together fit in ~60
characters of printable ASCII.

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

Splits, streams, demonstrations and verification are the shared ones of rewards/procedural.py: an
instance is held out iff blake2b(f"{type}:{prompt}") % 10 == 0, so the rule is per domain type (datasets
of one type with different names or seeds share it).
"""

from __future__ import annotations

import random
import string
from typing import Any

from rewards.procedural import ProceduralTask


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
        return f"rev {s}=", [], s[::-1], {}


class UppercaseTask(ProceduralTask):
    kind = "uppercase"

    def draw(self, rng):
        return _lowercase(rng, self.cfg)

    def render(self, s):
        return f"up {s}=", [], s.upper(), {}


class SortDigitsTask(ProceduralTask):
    kind = "sort_digits"

    def draw(self, rng):
        return _lowercase(rng, self.cfg, string.digits)

    def render(self, s):
        return f"sort {s}=", [], "".join(sorted(s)), {}


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
        return f"cnt {c}:{s}=", ["".join(running)], str(n), {}


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
        return f"{a}-{b}=", subtraction_lines(a, b), str(a - b), {}


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
        return f"{a}*{d}=", multiply_lines(a, d), str(a * d), {}


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
        return f"{n}%{m}=", lines, str(n % m), {}


class MaxListTask(ProceduralTask):
    kind = "max_list"

    def draw(self, rng):
        return tuple(rng.randint(10, 99) for _ in range(rng.randint(self.cfg.min_items, self.cfg.max_items)))

    def render(self, xs):
        running, best = [], xs[0]
        for x in xs:
            best = max(best, x)
            running.append(str(best))
        return f"max {','.join(map(str, xs))}=", [" ".join(running)], str(best), {}


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
        return f"{n}>b{k}=", lines, "".join(reversed(digits)) or "0", {}


class DigitSumTask(ProceduralTask):
    kind = "digit_sum"

    def draw(self, rng):
        return _number(rng, self.cfg.min_digits, self.cfg.max_digits)

    def render(self, n):
        running, total = [], 0
        for ch in str(n):
            total += int(ch)
            running.append(str(total))
        return f"dsum {n}=", [" ".join(running)], str(total), {}


DOMAIN_CLASSES: dict[str, type[ProceduralTask]] = {
    cls.kind: cls
    for cls in (ReverseTask, UppercaseTask, SortDigitsTask, CountCharTask, SubtractionTask, MultiplyDigitTask,
                ModuloTask, MaxListTask, BaseConversionTask, DigitSumTask)
}
"""The procedural domains besides addition, by config `type`."""

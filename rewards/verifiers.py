"""Verifiers of the file datasets (rewards/datasets.py): how a response is judged against a row's answer.

A recipe picks one per dataset with `verifier:`, a string or a mapping:

- `exact` (`{type: exact, compare: last_line | whole, case_sensitive}`): the response's last non-blank
  line (default) or the whole response equals the answer, both with whitespace runs collapsed to one
  space and the ends stripped.
- `math` (`{type: math, timeout_s}`): the response's final answer, as math-verify extracts it (an
  "answer is"/"answer:" phrase first, else a \\boxed{} or $...$ expression, else the last number or
  expression), is mathematically equal to the answer. Any clear final answer counts: "The answer is
  42.", "**42**", "\\boxed{42}", "42 apples". math-verify's own timeouts bound parsing and comparing.
  When the reference is a number, the final answer must be written as one (`literal_numbers`, default
  true): "42", "42.0", "1,000", and for a non-integer reference "3/4" or "\\frac{3}{4}"; an expression that
  evaluates to it ("84/2", "21 / 9 + 96 / 9") is not an answer. math-verify evaluates expressions, and a
  policy learns to exploit that: GRPO on SmolLM2 learned to reply "21 / 9 + 96 / 9 = N" and scored 1.0.
- `regex` (`{type: regex, pattern, compare: exact | math, ignore_case}`): the pattern's last match in
  the response (its group `answer`, else its group 1, else the whole match) compared with the answer.
- `python:pkg.module:fn` (`{type: python, function: "pkg.module:fn", correct_at, timeout_s, max_failures_in_a_row}`):
  a function of the user's that fits `RewardFunction`; `rl validate` imports it and checks its signature. Each
  call runs in a supervised child process (rewards/supervised.py), killed with what it started after `timeout_s`
  (default 10; null: no limit); a call that exits, dies, hangs or returns no valid verdict scores 0 with the true
  reason, and `max_failures_in_a_row` (default 20) of those in a row stop the job with one line.

Each config's `build()` returns a `Verifier`: (trajectory, answer, row) -> Verdict, which never raises
(a failure is a reward 0 with the reason) and whose reason says what it read ("parsed 42, expected 41",
"no answer found").
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from configbase import StrictConfig
from rewards.reward_functions import (RewardFunction, load_cached, load_reward_function, outcome_by_path,  # noqa: F401
                                      python_outcome, python_verdict, reward_function_problem)
from rewards.supervised import ChildFailure, run_supervised
from rewards.task import Trajectory, Verdict

Verifier = Callable[[Trajectory, str, Mapping[str, Any]], Verdict]
"""A built verifier: (trajectory, reference answer, the dataset row) -> Verdict; never raises."""


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- exact -------------------------------------------------------------------------------------------


def _on_response(judge: Callable[..., Verdict], trajectory: Trajectory, answer: str, row: Mapping[str, Any], **options) -> Verdict:
    """A verifier of the response text alone (a module-level partial, so built verifiers pickle)."""
    return judge(trajectory.response, answer, **options)


def normalise(text: str) -> str:
    """Ends stripped, every whitespace run one space."""
    return " ".join(text.split())


def exact_verdict(response: str, answer: str, *, compare: str = "last_line", case_sensitive: bool = True) -> Verdict:
    """Reward 1 iff the last non-blank line (or the whole response) equals the answer after `normalise`."""
    text = response.strip()
    if not text:
        return Verdict(0.0, False, "empty response", answered=False)
    got = normalise(text.splitlines()[-1] if compare == "last_line" else text)
    want = normalise(answer)
    ok = got == want if case_sensitive else got.casefold() == want.casefold()
    return Verdict(float(ok), ok, f"answer {_short(got)!r}" + ("" if ok else f", expected {_short(want)!r}"), answered=True)


class ExactVerifierConfig(StrictConfig):
    """The response (its last line, or all of it) equals the answer, whitespace-normalised."""

    type: Literal["exact"] = "exact"
    """Discriminator: exact comparison."""
    compare: Literal["last_line", "whole"] = "last_line"
    """What is compared with the answer: the last non-blank line of the response, or the whole response."""
    case_sensitive: bool = True
    """False: compare case-folded."""

    def build(self) -> Verifier:
        return partial(_on_response, exact_verdict, compare=self.compare, case_sensitive=self.case_sensitive)


# ---- math (math-verify) ------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def parse_reference(answer: str, timeout_s: int = 2) -> tuple:
    """math-verify's parse of a reference answer: as written ("1,000", "42 apples"), else as LaTeX
    (\\boxed{answer}: "x^2+1", "(1,2)"); () when neither gives a math object ("???"). Off the main thread
    it runs without a timeout (SIGALRM needs the main thread): references are the recipe's data, not the
    policy's output."""
    from math_verify import parse  # sympy: imported where answers are checked, never by `rl validate`

    limit = timeout_s if threading.current_thread() is threading.main_thread() else None
    for text in (answer, f"\\boxed{{{answer}}}"):
        parsed = parse(text, parsing_timeout=limit)
        if any(not isinstance(p, str) for p in parsed):  # a math object, not only math-verify's raw-text fallback
            return tuple(parsed)
    return ()


def _shown(parsed: list) -> str:
    """The text math-verify extracted (its last item is the matched string); never str() of a sympy object,
    which can itself take unbounded time."""
    return _short(parsed[-1].strip("*$ ") if isinstance(parsed[-1], str) else "an expression")


_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_FRACTION = re.compile(r"[+-]?(?:\d+\s*/\s*\d+|\\[dt]?frac\{\d+\}\{\d+\})")


def _written_as_number(shown: str, gold: tuple) -> bool:
    """Whether math-verify's extracted answer text is a number as a person writes one: an integer or decimal
    (with thousands separators), or, when the reference is not an integer, a plain fraction. True when the
    reference is not a number (an expression, a set, an interval: nothing to hold the answer to)."""
    numbers = [g for g in gold if getattr(g, "is_Float", False) or (getattr(g, "is_number", False) and g.is_rational)]
    if not numbers:  # includes irrational references (\sqrt{2}, 2\pi): written as expressions anyway
        return True
    text = shown.strip().strip("*$").strip().rstrip(".").strip()
    if _NUMBER.fullmatch(text):
        return True
    return not all(g.is_integer for g in numbers) and bool(_FRACTION.fullmatch(text))


def _math_verdict_here(response: str, answer: str, timeout_s: int, literal_numbers: bool = True) -> Verdict:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    gold = parse_reference(answer, timeout_s)
    if not gold:
        return Verdict(0.0, False, f"reference {_short(answer)!r} is not parseable by math-verify")
    try:
        pred = parse(response, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        return Verdict(0.0, False, f"parsing the response timed out ({timeout_s} s)")
    except Exception as e:  # math-verify's own parse failure: the response has no usable answer
        return Verdict(0.0, False, f"no answer found (math-verify: {type(e).__name__})", answered=False)
    if not pred:
        return Verdict(0.0, False, "no answer found", answered=False)
    shown = _shown(pred)
    if literal_numbers and isinstance(pred[-1], str) and not _written_as_number(pred[-1], gold):
        return Verdict(0.0, False, f"parsed {shown}: an expression, not a number (the reference is {_short(answer)})",
                       answered=False)
    for g in gold:
        for p in pred:
            try:
                if verify(g, p, timeout_seconds=timeout_s, raise_on_error=True):
                    return Verdict(1.0, True, f"parsed {shown}", answered=True)
            except TimeoutException:  # a pathological expression: no other pair is worth another timeout
                return Verdict(0.0, False, f"parsed {shown}, comparing with {_short(answer)} timed out ({timeout_s} s)", answered=True)
            except Exception:  # sympy cannot compare this pair (e.g. a set with a number): not equal
                continue
    return Verdict(0.0, False, f"parsed {shown}, expected {_short(answer)}", answered=True)


def _import_math_verify() -> None:
    """A child's prepare step before math: importing sympy takes seconds, not counted in the verdict's limit."""
    import math_verify  # noqa: F401


def _in_child(fn: Callable[..., Any], args: tuple, wait_s: float, timed_out: str) -> Any:
    """`fn(*args)` (math-verify's work) in the supervised child process verdicts run in (rewards/supervised.py), killed
    and replaced when it overruns `wait_s`; then a 0 Verdict whose reason is `timed_out` (or says how the child
    ended). No input hangs the caller, whatever thread it runs on (SIGALRM-based limits need a main thread; a thread
    cannot be stopped)."""
    got = run_supervised(fn, args, wait_s, prepare=(_import_math_verify, ()))
    if not isinstance(got, ChildFailure):
        return got
    return Verdict(0.0, False, timed_out if got.kind == "timed_out" else f"math verification's child process {got.what}")


def _math_verdict_in_child(response: str, answer: str, timeout_s: int, literal_numbers: bool = True) -> Verdict:
    """Off the main thread math-verify's SIGALRM timeouts cannot run: the child does the work with them."""
    return _in_child(_math_verdict_here, (response, answer, timeout_s, literal_numbers), 4 * timeout_s,
                     f"math verification timed out in its child process ({timeout_s} s limits)")


def _math_verdicts_here(pairs: Sequence[tuple[str, str]], timeout_s: int, literal_numbers: bool) -> list[Verdict]:
    return [_math_verdict_here(r, a, timeout_s, literal_numbers) for r, a in pairs]


def math_verdicts(pairs: Sequence[tuple[str, str]], timeout_s: int = 2, literal_numbers: bool = True) -> list[Verdict]:
    """`math_verdict` of each (response, answer). Off the main thread the whole batch is one call to the child
    process (one round trip, not one per sample: 0.23 against 0.59 ms a verdict on a reward actor's thread,
    bench/reward_verify.py); its limit is each verdict's bound summed. A batch that overruns it is verified again
    one by one, so only the sample that hangs scores 0 for it."""
    if threading.current_thread() is threading.main_thread() or len(pairs) < 2:
        return [math_verdict(r, a, timeout_s, literal_numbers) for r, a in pairs]
    timed_out = "math verification timed out in its child process"
    got = _in_child(_math_verdicts_here, (list(pairs), timeout_s, literal_numbers), (2 * len(pairs) + 2) * timeout_s,
                    timed_out)
    if isinstance(got, Verdict):  # the batch overran: one by one
        return [_math_verdict_in_child(r, a, timeout_s, literal_numbers) for r, a in pairs]
    return got


def math_verdict(response: str, answer: str, timeout_s: int = 2, literal_numbers: bool = True) -> Verdict:
    """Reward 1 iff math-verify finds a final answer in `response` equal to `answer` (written as a number when
    the answer is a number, with `literal_numbers`); never raises or hangs: parsing and each comparison stop
    after `timeout_s` (a timeout scores 0, with the reason)."""
    if threading.current_thread() is threading.main_thread():
        return _math_verdict_here(response, answer, timeout_s, literal_numbers)
    return _math_verdict_in_child(response, answer, timeout_s, literal_numbers)


class MathVerifierConfig(StrictConfig):
    """The response's final answer equals the answer mathematically (math-verify)."""

    type: Literal["math"] = "math"
    """Discriminator: math-verify."""
    timeout_s: int = Field(2, ge=1, le=60)
    """math-verify's limit, whole seconds (SIGALRM), on parsing the response and on each comparison; a
    verdict takes at most about twice this."""
    literal_numbers: bool = True
    """When the reference is a number, the final answer must be written as a number ("42", "1,000", "3/4" for a
    non-integer), not as an expression that evaluates to it ("84/2"): a reward a policy cannot get by leaving
    the arithmetic to math-verify. False: any expression equal to the answer counts."""

    def build(self) -> Verifier:
        return MathVerifier(self.timeout_s, self.literal_numbers)


@dataclass(frozen=True)
class MathVerifier:
    """The built math verifier: a `Verifier`, and `many` for a batch (one child call off the main thread)."""

    timeout_s: int
    literal_numbers: bool

    def __call__(self, trajectory: Trajectory, answer: str, row: Mapping[str, Any]) -> Verdict:
        return math_verdict(trajectory.response, answer, self.timeout_s, self.literal_numbers)

    def many(self, items: Sequence[tuple[Trajectory, str, Mapping[str, Any]]]) -> list[Verdict]:
        return math_verdicts([(t.response, answer) for t, answer, _ in items], self.timeout_s, self.literal_numbers)


# ---- regex -------------------------------------------------------------------------------------------


class RegexVerifierConfig(StrictConfig):
    """The pattern's last match in the response, compared with the answer."""

    type: Literal["regex"] = "regex"
    """Discriminator: extract with a regular expression."""
    pattern: str = Field(min_length=1)
    """Python regular expression; what it extracts is its group `answer`, else its group 1, else the match.
    It runs on the response with no time limit (Python's re has none): avoid nested quantifiers."""
    compare: Literal["exact", "math"] = "exact"
    """exact: equal after whitespace normalisation; math: mathematically equal (math-verify)."""
    ignore_case: bool = False
    """Match the pattern, and compare exactly, ignoring case."""
    timeout_s: int = Field(2, ge=1, le=60)
    """With compare: math, math-verify's limit (see the math verifier)."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"not a valid regular expression ({e})") from None
        return pattern

    def extract(self, response: str) -> str | None:
        rx = re.compile(self.pattern, re.IGNORECASE if self.ignore_case else 0)
        last = None
        for last in rx.finditer(response):
            pass
        if last is None:
            return None
        if "answer" in rx.groupindex:
            return last.group("answer") or ""
        return (last.group(1) or "") if rx.groups else last.group(0)

    def verdict(self, response: str, answer: str) -> Verdict:
        got = self.extract(response)
        if got is None:
            return Verdict(0.0, False, "no match of the pattern", answered=False)
        if self.compare == "math":  # the pattern says where the answer is: whatever it holds is compared as math
            return math_verdict(got, answer, self.timeout_s, literal_numbers=False)
        return exact_verdict(got, answer, compare="whole", case_sensitive=not self.ignore_case)

    def build(self) -> Verifier:
        return partial(_on_response, self.verdict)


# ---- python ------------------------------------------------------------------------------------------


class RewardFunctionFailed(RuntimeError):
    """A `python:` verifier failed (crashed, hung, returned no valid verdict) `max_failures_in_a_row` calls in a row:
    the job stops rather than train on zeros. `rl train` prints it as one line and exits 2."""


@dataclass
class PythonVerifier:
    """The built `python:` verifier: each call in the supervised child process (rewards/supervised.py). A call that
    crashes, overruns `timeout_s` or returns no valid verdict scores 0 with the true reason; `max_failures_in_a_row`
    of those in a row raise RewardFunctionFailed. An exception the function raises is the sample's (a verdict with
    the error, as the README promises) and does not count: a policy's early answers may make any parser raise."""

    function: str
    correct_at: float
    timeout_s: float | None
    max_failures_in_a_row: int
    failures_in_a_row: int = 0

    def __call__(self, trajectory: Trajectory, answer: str, row: Mapping[str, Any]) -> Verdict:
        got = run_supervised(outcome_by_path, (self.function, trajectory, answer, dict(row), self.correct_at),
                             self.timeout_s, prepare=(load_cached, (self.function,)))
        if isinstance(got, Verdict):
            self.failures_in_a_row = 0
            return got
        if got.kind != "cut_short":  # a preempted job's stop is not the function's failure
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.max_failures_in_a_row:
                raise RewardFunctionFailed(f"the reward function {self.function} failed {self.failures_in_a_row} times "
                                           f"in a row (last: {got.what})")
        return Verdict(0.0, False, f"the reward function {got.what}")


class PythonVerifierConfig(StrictConfig):
    """A reward function of the user's, named by import path and checked against `RewardFunction`."""

    type: Literal["python"] = "python"
    """Discriminator: a Python reward function (shorthand `verifier: python:pkg.module:fn`)."""
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path "pkg.module:fn" (importable where the job runs)."""
    correct_at: float = 1.0
    """A numeric reward counts as correct (accuracy metrics) when it is at least this."""
    timeout_s: float | None = Field(10.0, gt=0)
    """Wall-clock limit of one call, seconds. Every call runs in a supervised child process (its own process group):
    past the limit the child and whatever it started are killed, the sample scores 0 with the reason, and a fresh
    child takes the next call. null: no limit (the call still runs in the child, which a crash or a preemption
    ends)."""
    max_failures_in_a_row: int = Field(20, ge=1)
    """The job stops (one line, exit 2) when this many calls in a row crash (exit, KeyboardInterrupt, a signal),
    overrun `timeout_s` or return no valid verdict (each scores its sample 0 with the reason): a broken function
    would otherwise train on zeros. An exception the function raises is its sample's error and does not count."""

    @model_validator(mode="after")
    def _fits(self) -> "PythonVerifierConfig":
        load_reward_function(self.function)
        return self

    def build(self) -> Verifier:
        return PythonVerifier(self.function, self.correct_at, self.timeout_s, self.max_failures_in_a_row)


VerifierConfig = Annotated[Union[ExactVerifierConfig, MathVerifierConfig, RegexVerifierConfig, PythonVerifierConfig],
                           Field(discriminator="type")]
"""A dataset's verifier, by `type`; `verifier_shorthand` reads the string forms."""


def verifier_shorthand(value: Any) -> Any:
    """`exact`, `math`, `regex` -> {type: ...}; `python:pkg.module:fn` -> {type: python, function: ...}."""
    if not isinstance(value, str):
        return value
    if value in ("exact", "math", "regex"):
        return {"type": value}
    if value.startswith("python:"):
        return {"type": "python", "function": value[len("python:"):]}
    raise ValueError(f"unknown verifier {value!r}: use exact, math, regex (with a pattern) or python:pkg.module:fn")

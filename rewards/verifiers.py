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
- `python:pkg.module:fn` (`{type: python, function: "pkg.module:fn", correct_at, timeout_s}`): a function of
  the user's that fits `RewardFunction`; `rl validate` imports it and checks its signature. Each call runs
  in a child process killed after `timeout_s` (default 10; null: in the caller, unbounded).

Each config's `build()` returns a `Verifier`: (trajectory, answer, row) -> Verdict, which never raises
(a failure is a reward 0 with the reason) and whose reason says what it read ("parsed 42, expected 41",
"no answer found").
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import math
import multiprocessing
import re
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Annotated, Any, Literal, Protocol, Union, get_args, get_origin, get_type_hints

from pydantic import Field, field_validator, model_validator

from configbase import StrictConfig
from rewards.task import Trajectory, Verdict

Verifier = Callable[[Trajectory, str, Mapping[str, Any]], Verdict]
"""A built verifier: (trajectory, reference answer, the dataset row) -> Verdict; never raises."""


class RewardFunction(Protocol):
    """The signature of a `python:` verifier (checked by `rl validate`): the trajectory (its `.response` is
    the policy's answer), the row's answer as text, and the whole row (a dict of JSON values). Returns a
    Verdict, a number (the reward; correct when >= `correct_at`), or a bool (reward 1 or 0)."""

    def __call__(self, trajectory: Trajectory, answer: str, row: dict[str, Any], /) -> Verdict | float | bool: ...


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


_CHILD_START_S = 30.0
"""Time a fresh child process may take to start and import sympy before its first verdict."""
_child_lock = threading.Lock()
_child_pool: Any = None


def _in_child(fn: Callable[..., Verdict], args: tuple, wait_s: float, timed_out: str, *, start_allowance: bool = False
              ) -> Verdict:
    """`fn(*args)` in the one child process verdicts may run in, killed (and replaced at the next call)
    when it overruns `wait_s` (plus `_CHILD_START_S` on the child's first call, or always with
    `start_allowance`); then a 0 Verdict whose reason is `timed_out`. No input hangs the caller, whatever
    thread it runs on (SIGALRM-based limits need a main thread; a thread cannot be stopped)."""
    global _child_pool
    with _child_lock:
        fresh = _child_pool is None
        if fresh:
            _child_pool = multiprocessing.get_context("spawn").Pool(1)
            atexit.register(_child_pool.terminate)
        pool = _child_pool
    try:
        return pool.apply_async(fn, args).get(wait_s + (_CHILD_START_S if fresh or start_allowance else 0.0))
    except multiprocessing.TimeoutError:
        with _child_lock:
            if _child_pool is pool:
                pool.terminate()
                _child_pool = None
        return Verdict(0.0, False, timed_out)


def _math_verdict_in_child(response: str, answer: str, timeout_s: int, literal_numbers: bool = True) -> Verdict:
    """Off the main thread math-verify's SIGALRM timeouts cannot run: the child does the work with them."""
    return _in_child(_math_verdict_here, (response, answer, timeout_s, literal_numbers), 4 * timeout_s,
                     f"math verification timed out in its child process ({timeout_s} s limits)", start_allowance=True)


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
                    timed_out, start_allowance=True)
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


def _accepts(hint: Any, value_type: type) -> bool:
    """Whether a parameter annotated `hint` accepts a `value_type` argument."""
    if hint in (Any, object, inspect.Parameter.empty):
        return True
    origin = get_origin(hint)
    if origin is Annotated:
        return _accepts(get_args(hint)[0], value_type)
    if origin in (Union, types.UnionType):
        return any(_accepts(h, value_type) for h in get_args(hint))
    base = origin or hint
    return isinstance(base, type) and issubclass(value_type, base)


def _returns_ok(hint: Any) -> bool:
    """Whether every type in a return annotation is one a reward function may return."""
    if hint in (Any, inspect.Parameter.empty):
        return True
    if get_origin(hint) in (Union, types.UnionType):
        return all(_returns_ok(h) for h in get_args(hint))
    return isinstance(hint, type) and issubclass(hint, (Verdict, float, int))  # bool is an int


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else repr(hint).replace("typing.", "")


def reward_function_problem(fn: Any) -> str | None:
    """Why `fn` does not fit `RewardFunction`, or None when it does."""
    if not callable(fn):
        return f"is a {type(fn).__name__}, not a function"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to check
    try:
        bound = sig.bind(None, "", {})
    except TypeError as e:
        return f"takes {sig}, which does not accept (trajectory, answer, row) ({e})"
    try:
        hints = get_type_hints(fn)
    except Exception:  # annotations naming what only a type checker imports: the call shape was checked above
        hints = {}
    for (name, _), expected in zip(bound.arguments.items(), (Trajectory, str, dict)):
        param = sig.parameters[name]
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if not _accepts(hints.get(name, inspect.Parameter.empty), expected):
            return f"parameter {name!r} is annotated {_type_name(hints[name])}, but it receives a {expected.__name__}"
    if not _returns_ok(hints.get("return", inspect.Parameter.empty)):
        return f"its return annotation is {_type_name(hints['return'])}, not Verdict | float | bool"
    return None


def load_reward_function(path: str) -> Callable[..., Any]:
    """Import "pkg.module:fn" and check it against `RewardFunction`; ValueError (one line) when it does not fit."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import reward function module {module_name!r} ({e})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{path!r}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    problem = reward_function_problem(fn)
    if problem:
        raise ValueError(f"reward function {path!r} does not fit RewardFunction (rewards/verifiers.py: "
                         f"(trajectory: Trajectory, answer: str, row: dict) -> Verdict | float | bool): {problem}")
    return fn


def bounded_python_verdict(function: str, trajectory: Trajectory, answer: str, row: Mapping[str, Any], *,
                           correct_at: float = 1.0, timeout_s: float = 10.0) -> Verdict:
    """`python_verdict` of the reward function at import path `function`, run in the verdict child process
    and stopped after `timeout_s` (a function that hangs scores 0 with the reason; the job goes on)."""
    return _in_child(_python_verdict_by_path, (function, trajectory, answer, dict(row), correct_at), timeout_s,
                     f"reward function {function} timed out in its child process ({timeout_s:g} s)")


def _python_verdict_by_path(function: str, trajectory: Trajectory, answer: str, row: dict, correct_at: float) -> Verdict:
    return python_verdict(_load_cached(function), trajectory, answer, row, correct_at=correct_at)


@lru_cache(maxsize=64)
def _load_cached(function: str) -> Callable[..., Any]:
    return load_reward_function(function)


def python_verdict(fn: Callable[..., Any], trajectory: Trajectory, answer: str, row: Mapping[str, Any], *,
                   correct_at: float = 1.0) -> Verdict:
    """The user's function's judgement as a Verdict; an error or a wrong return type scores 0 with the reason."""
    try:
        out = fn(trajectory, answer, dict(row))
    except Exception as e:  # the user's code: its failure is the sample's, with the error as the reason
        return Verdict(0.0, False, f"reward function error: {type(e).__name__}: {_short(str(e), 200)}")
    if isinstance(out, Verdict):
        return out
    if isinstance(out, bool):
        return Verdict(float(out), out, f"reward function: {out}")
    if isinstance(out, (int, float)) and math.isfinite(out):
        return Verdict(float(out), out >= correct_at, f"reward function: {out:g}")
    return Verdict(0.0, False, f"reward function returned {_short(repr(out))}, not Verdict | float | bool")


class PythonVerifierConfig(StrictConfig):
    """A reward function of the user's, named by import path and checked against `RewardFunction`."""

    type: Literal["python"] = "python"
    """Discriminator: a Python reward function (shorthand `verifier: python:pkg.module:fn`)."""
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path "pkg.module:fn" (importable where the job runs)."""
    correct_at: float = 1.0
    """A numeric reward counts as correct (accuracy metrics) when it is at least this."""
    timeout_s: float | None = Field(10.0, gt=0)
    """Wall-clock limit of one call: the function runs in a child process that is killed past it (the sample
    scores 0 with the reason). null: call it in the reward worker itself, unbounded (no process hop)."""

    @model_validator(mode="after")
    def _fits(self) -> "PythonVerifierConfig":
        load_reward_function(self.function)
        return self

    def build(self) -> Verifier:
        if self.timeout_s is None:
            return partial(python_verdict, load_reward_function(self.function), correct_at=self.correct_at)
        return partial(bounded_python_verdict, self.function, correct_at=self.correct_at, timeout_s=self.timeout_s)


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

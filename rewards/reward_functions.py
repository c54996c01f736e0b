"""Users' reward functions (`verifier: python:pkg.module:fn`): the `RewardFunction` protocol, the check `rl validate`
runs on one, loading one by import path, and what one call of it means as a Verdict. A module of its own, light on
purpose (no pydantic models): the supervised child that runs the calls (rewards/supervised.py) imports this, not
rewards/verifiers.py, so a child that dies is replaced in a fraction of a second."""

from __future__ import annotations

import importlib
import inspect
import math
import types
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Annotated, Any, Protocol, Union, get_args, get_origin, get_type_hints

from rewards.supervised import Invalid, verdict_problem
from rewards.task import Trajectory, Verdict


class RewardFunction(Protocol):
    """The signature of a `python:` verifier (checked by `rl validate`): the trajectory (its `.response` is
    the policy's answer), the row's answer as text, and the whole row (a dict of JSON values). Returns a
    Verdict, a number (the reward; correct when >= `correct_at`), or a bool (reward 1 or 0)."""

    def __call__(self, trajectory: Trajectory, answer: str, row: dict[str, Any], /) -> Verdict | float | bool: ...


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        raise ValueError(f"reward function {path!r} does not fit RewardFunction (rewards/reward_functions.py: "
                         f"(trajectory: Trajectory, answer: str, row: dict) -> Verdict | float | bool): {problem}")
    return fn


def outcome_by_path(function: str, trajectory: Trajectory, answer: str, row: dict, correct_at: float) -> Verdict | Invalid:
    """`python_outcome` of the function at import path `function` (what a `python:` verifier's child runs)."""
    return python_outcome(load_cached(function), trajectory, answer, row, correct_at=correct_at)


@lru_cache(maxsize=64)
def load_cached(function: str) -> Callable[..., Any]:
    """`load_reward_function`, once per process (a child's prepare step)."""
    return load_reward_function(function)


def python_outcome(fn: Callable[..., Any], trajectory: Trajectory, answer: str, row: Mapping[str, Any], *,
                   correct_at: float = 1.0) -> Verdict | Invalid:
    """The user's function's judgement as a Verdict (an exception it raises scores 0 with the error as the reason), or
    Invalid when what it returned is no valid Verdict, number or bool."""
    try:
        out = fn(trajectory, answer, dict(row))
    except Exception as e:  # the user's code: its failure is the sample's, with the error as the reason
        return Verdict(0.0, False, f"reward function error: {type(e).__name__}: {_short(str(e), 200)}")
    if isinstance(out, Verdict):
        problem = verdict_problem(out)
        return Invalid(problem) if problem else out
    if isinstance(out, bool):
        return Verdict(float(out), out, f"reward function: {out}")
    if isinstance(out, (int, float)) and math.isfinite(out):
        return Verdict(float(out), out >= correct_at, f"reward function: {out:g}")
    return Invalid(f"{_short(repr(out))}, not Verdict | float | bool")


def python_verdict(fn: Callable[..., Any], trajectory: Trajectory, answer: str, row: Mapping[str, Any], *,
                   correct_at: float = 1.0) -> Verdict:
    """`python_outcome` in the caller's process, an Invalid result as a 0 Verdict with the reason."""
    out = python_outcome(fn, trajectory, answer, row, correct_at=correct_at)
    return out if isinstance(out, Verdict) else Verdict(0.0, False, f"the reward function returned {out.what}")

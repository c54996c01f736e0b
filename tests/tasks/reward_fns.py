"""Reward functions written outside rewards/, as a user would, for `verifier: python:tests.tasks.reward_fns:<fn>`."""

from __future__ import annotations

from typing import Any

from rewards import Trajectory, Verdict


def echo_length(trajectory: Trajectory, answer: str, row: dict[str, Any]) -> Verdict | float | bool:
    """Fits the protocol: reward 1 when the response is the answer, else half credit when it has the row's `hint`."""
    said = trajectory.response.strip()
    if said == answer:
        return True
    return 0.5 if row.get("hint") and row["hint"] in said else 0.0


def graded(trajectory, answer, row):
    """Unannotated, returns a Verdict of its own."""
    return Verdict(0.25, False, f"graded {row['q']}")


def two_args(trajectory: Trajectory, answer: str) -> float:
    """Does not fit: no row parameter."""
    return 1.0


def wrong_answer_type(trajectory: Trajectory, answer: int, row: dict) -> float:
    """Does not fit: the answer arrives as a str."""
    return 1.0


def returns_text(trajectory: Trajectory, answer: str, row: dict) -> str:
    """Does not fit: returns a str."""
    return "yes"


def raises(trajectory, answer, row):
    raise RuntimeError("boom")


def returns_none(trajectory, answer, row):
    return None


NOT_A_FUNCTION = 3


def hangs(trajectory: Trajectory, answer: str, row: dict) -> float:
    """Never returns (a user's bug): the bounded verifier must stop it."""
    while True:
        pass


def first_char_even(trajectory: Trajectory, answer: str, row: dict) -> float:
    """A coin per sample (the parity of the response's first character): groups both split and uniform."""
    said = trajectory.response
    return float(bool(said) and ord(said[0]) % 2 == 0)

"""The math verifier's literal-number rule (rewards/verifiers.py, `literal_numbers`): when the reference is a number
the final answer must be written as one. An integer or a decimal (thousands separators, a sentence's final period)
always counts; a plain fraction counts only for a non-integer reference (decimal or fractional); an expression that
evaluates to the reference never does (a policy learns to reply "84/2" or "1/2 + 1/4"). Runs the real math-verify
in this process (main thread)."""

import pytest

from rewards.verifiers import math_verdict

CASES = [
    # (response, reference, scores)
    ("The answer is 42.", "42", True),
    ("$42.$", "42", True),  # math-verify keeps the period here
    ("\\boxed{1,000}", "1000", True),  # and the thousands separator here
    ("The answer is 84/2", "42", False),  # a fraction is an expression for an integer reference
    ("The answer is 0.75", "0.75", True),
    ("The answer is 12,345.5", "12345.5", True),
    ("The answer is 3/4", "0.75", True),  # a decimal reference: a plain fraction counts
    ("Answer: 3 / 4", "0.75", True),
    ("The answer is 1/2 + 1/4", "0.75", False),  # an expression does not
    ("The answer is 0.75", "3/4", True),  # a fractional reference: a decimal counts
    ("The answer is $\\dfrac{3}{4}$", "3/4", True),
    ("Answer: 3 / 4", "\\frac{3}{4}", True),
    ("The answer is 1/2 + 1/4", "3/4", False),
    ("\\boxed{0.5 + 0.25}", "0.75", False),
]


@pytest.mark.parametrize("response, reference, scores", CASES)
def test_literal_numbers_for_integer_decimal_and_fractional_references(response, reference, scores):
    v = math_verdict(response, reference)
    assert v.correct is scores, v.reason
    if not scores:
        assert "an expression, not a number" in v.reason


def test_without_the_rule_an_equal_expression_scores():
    assert math_verdict("The answer is 1/2 + 1/4", "0.75", literal_numbers=False).correct

"""Addition task family: scratchpad format, slip model, generator, splits and verifier."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from model.tokenizer import CharTokenizer
from rewards.arithmetic import ArithmeticTask, worked_solution
from rewards.task import Problem
from rewards.config import ArithmeticConfig
from tests.conftest import parsed, verify_text

_LINE = re.compile(r"(\d)\+(\d)(\+1)?=(\d{1,2})")


def _task(**overrides) -> ArithmeticTask:
    return ArithmeticTask(ArithmeticConfig(**overrides))


def _columns(text: str) -> list[tuple[int, int, int, int]]:
    """(da, db, carry_in, s) per column line; fails on any line that is not in the column format."""
    cols = []
    for line in text.splitlines()[:-1]:
        m = _LINE.fullmatch(line)
        assert m, f"malformed column line {line!r}"
        cols.append((int(m[1]), int(m[2]), 1 if m[3] else 0, int(m[4])))
    return cols


def _random_operand(rng: random.Random) -> int:
    return rng.randint(0, 10 ** rng.randint(1, 9) - 1)


# ---- format -------------------------------------------------------------------------------------


def test_brief_example_exact():
    assert worked_solution(372, 589) == "2+9=11\n7+8+1=16\n3+5+1=9\n961"
    p = _task(name="ar").make_problem((372, 589))
    assert (p.problem_id, p.dataset, p.prompt, p.answer) == ("ar:372+589", "ar", "372+589=", "961")
    assert p.metadata["solution"] == "2+9=11\n7+8+1=16\n3+5+1=9\n961"


@pytest.mark.parametrize(
    "a, b, text",
    [
        (0, 0, "0+0=0\n0"),
        (5, 7, "5+7=12\n12"),
        (999, 1, "9+1=10\n9+0+1=10\n9+0+1=10\n1000"),  # zero padding of the shorter operand
        (1, 999, "1+9=10\n0+9+1=10\n0+9+1=10\n1000"),
        (40, 60, "0+0=0\n4+6=10\n100"),
    ],
)
def test_worked_solution_by_hand(a, b, text):
    assert worked_solution(a, b) == text


def test_clean_solutions_are_correct_and_consistent_for_random_pairs():
    task = _task()
    rng = random.Random(123)
    for _ in range(2000):
        a, b = _random_operand(rng), _random_operand(rng)
        p = task.make_problem((a, b))
        assert p.metadata["solution"].splitlines()[-1] == str(a + b)
        assert verify_text(task, p, p.metadata["solution"]).correct
        cols = _columns(p.metadata["solution"])
        assert len(cols) == max(len(str(a)), len(str(b)))
        carry = 0
        for i, (da, db, c, s) in enumerate(cols):
            assert (da, db) == (a // 10**i % 10, b // 10**i % 10)
            assert c == carry and s == da + db + c
            carry = s // 10


# ---- slips --------------------------------------------------------------------------------------


def test_slip_drops_the_carry_and_continues_consistently():
    assert worked_solution(47, 55, slip=lambda i: True) == "7+5=12\n4+5+1=9\n92"
    # after the slip the next column has no carry-in, hence is no longer cascading
    assert worked_solution(1, 999, slip=lambda i: True) == "1+9=10\n0+9+1=9\n0+9=9\n990"


def test_slip_is_asked_only_in_cascading_columns():
    rng = random.Random(7)
    for _ in range(500):
        a, b = _random_operand(rng), _random_operand(rng)
        asked: list[int] = []
        text = worked_solution(a, b, slip=lambda i: asked.append(i) or False)
        assert text == worked_solution(a, b)
        cascading = [i for i, (da, db, c, _) in enumerate(_columns(text)) if c == 1 and da + db == 9]
        assert asked == cascading


def test_full_slip_rate_is_wrong_and_rejected_zero_rate_never_slips():
    problem = _task().make_problem((47, 55))
    always = _task(slip_rate=1.0).demonstration(problem, random.Random(0))
    assert always == "7+5=12\n4+5+1=9\n92"
    verdict = verify_text(_task(), problem, always)
    assert (verdict.reward, verdict.correct, parsed(verdict)) == (0.0, False, "92")

    never = _task(slip_rate=0.0)
    rng = random.Random(0)
    for p in never.heldout():
        assert never.demonstration(p, rng) == p.metadata["solution"]


def test_measured_slip_frequency_matches_slip_rate():
    task = _task(slip_rate=0.3)
    rng = random.Random(0)
    stream = task.train_stream()
    decisions = slips = 0
    for _ in range(20000):
        for da, db, c, s in _columns(task.demonstration(next(stream), rng)):
            if c == 1 and da + db == 9:
                decisions += 1
                slips += s == 9
        if decisions >= 2000:
            break
    assert decisions >= 2000
    assert abs(slips / decisions - 0.3) < 0.05


# ---- generator, reproducibility, splits ---------------------------------------------------------


def test_generator_respects_digit_range_and_leading_digit():
    task = _task(min_digits=3, max_digits=5)
    stream = task.train_stream()
    lengths: set[int] = set()
    for _ in range(2000):
        p = next(stream)
        lengths |= {len(str(p.metadata["a"])), len(str(p.metadata["b"]))}  # a leading zero would show up as a short length
    assert lengths == {3, 4, 5}
    singles = _task(min_digits=1, max_digits=1).train_stream()
    assert 0 in {next(singles).metadata["a"] for _ in range(500)}


def test_pair_nine_prob_forces_columns_to_sum_to_nine():
    def nine_fraction(prob: float) -> float:
        stream = _task(min_digits=4, max_digits=4, pair_nine_prob=prob).train_stream()
        nine = total = 0
        for _ in range(500):
            p = next(stream)
            for i in range(3):  # below b's leading digit the pairing is never overridden
                total += 1
                nine += p.metadata["a"] // 10**i % 10 + p.metadata["b"] // 10**i % 10 == 9
        return nine / total

    assert nine_fraction(1.0) == 1.0
    assert abs(nine_fraction(0.0) - 0.1) < 0.03


def test_same_seed_same_problems_different_seed_differs():
    def first(task: ArithmeticTask, n: int = 200, offset: int = 0) -> list[Problem]:
        stream = task.train_stream(offset)
        return [next(stream) for _ in range(n)]

    assert first(_task(seed=3)) == first(_task(seed=3))
    assert first(_task(seed=3)) != first(_task(seed=4))
    assert first(_task(seed=3)) != first(_task(seed=3), offset=1)
    assert _task(seed=3).heldout() == _task(seed=3).heldout()
    assert _task(seed=3).heldout() != _task(seed=4).heldout()


def test_train_and_heldout_never_share_a_pair():
    # A small pair space (<= 2 digits), where a stream without the split rule would collide.
    task = _task(min_digits=1, max_digits=2, num_heldout=200)
    heldout_pairs = {(p.metadata["a"], p.metadata["b"]) for p in task.heldout()}
    for offset in range(3):
        stream = task.train_stream(offset)
        train_pairs = {(p.metadata["a"], p.metadata["b"]) for p in (next(stream) for _ in range(3000))}
        assert len(train_pairs) > 1000
        assert not train_pairs & heldout_pairs


def test_heldout_size_and_distinct_pairs():
    task = _task(num_heldout=300)
    problems = task.heldout()
    assert len(problems) == 300
    assert len({(p.metadata["a"], p.metadata["b"]) for p in problems}) == 300
    assert len({p.problem_id for p in problems}) == 300


def test_heldout_fails_clearly_when_the_pair_space_is_too_small():
    with pytest.raises(ValueError, match="num_heldout"):
        _task(min_digits=1, max_digits=1, num_heldout=50).heldout()


def test_response_lengths_vary_several_fold():
    lengths = [len(p.metadata["solution"]) for p in _task(min_digits=1, max_digits=6).heldout()]
    assert max(lengths) / min(lengths) >= 4


# ---- verifier -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, correct, answer",
    [
        ("", False, None),
        ("   \n\n ", False, None),
        ("garbage", False, None),
        ("2+9=11\n7+8+1=16\nnine six one", False, None),
        ("96 1", False, None),
        ("961", True, "961"),
        ("961   ", True, "961"),
        ("2+9=11\n  961 \n\n", True, "961"),
        ("0961", False, "0961"),
        ("961\n960", False, "960"),  # only the last line counts
        ("\u0669\u0666\u0661", False, None),  # non-ASCII digits are not an answer
    ],
)
def test_verifier(response, correct, answer):
    task = _task()
    verdict = verify_text(task, task.make_problem((372, 589)), response)
    assert (verdict.correct, parsed(verdict), verdict.reward) == (correct, answer, 1.0 if correct else 0.0)


def test_verifier_never_raises_on_non_text():
    task = _task()
    verdict = verify_text(task, task.make_problem((1, 2)), None)  # type: ignore[arg-type]
    assert (verdict.reward, verdict.correct, parsed(verdict)) == (0.0, False, None)


# ---- tokenizer, config --------------------------------------------------------------------------


def test_all_text_is_encodable_by_the_char_tokenizer():
    tok = CharTokenizer()
    task = _task(slip_rate=0.5)
    rng = random.Random(0)
    for p in task.heldout():
        for text in (p.prompt, p.metadata["solution"], task.demonstration(p, rng)):
            assert tok.decode(tok.encode(text)) == text


def test_config_validation():
    with pytest.raises(ValidationError, match=r"max_digits=2.*min_digits=3"):
        ArithmeticConfig(min_digits=3, max_digits=2)
    for bad in ({"max_digits": 19}, {"slip_rate": 1.5}, {"pair_nine_prob": -0.1}, {"num_heldout": 0}):
        with pytest.raises(ValidationError):
            ArithmeticConfig(**bad)
    with pytest.raises(ValidationError, match="extra"):
        ArithmeticConfig(max_digit=4)  # a typo is an error, not a silent default
    cfg = ArithmeticConfig(min_digits=2, max_digits=2)
    assert isinstance(cfg.build(), ArithmeticTask) and cfg.build().name == "arith"
    assert ArithmeticConfig.model_fields["slip_rate"].description  # attribute docstrings are picked up

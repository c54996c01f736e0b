"""The file datasets' verifiers (rewards/verifiers.py): exact, math (math-verify, with its timeouts and the
child-process guard off the main thread), regex, and users' Python reward functions checked against the
`RewardFunction` protocol."""

import threading
import time

import pytest
from pydantic import TypeAdapter, ValidationError

from rewards import verifiers as V
from rewards.task import Problem, Trajectory, Verdict

VERIFIER = TypeAdapter(V.VerifierConfig)


def _judge(spec, response: str, answer: str, row: dict | None = None) -> Verdict:
    cfg = VERIFIER.validate_python(V.verifier_shorthand(spec))
    problem = Problem("d:1", "d", "q", answer)
    return cfg.build()(Trajectory.single(problem, response), answer, row or {})


def test_exact_compares_the_normalised_last_line_or_the_whole_response():
    assert _judge("exact", "work\n 41 +1\n\n  42  \n", "42") == Verdict(1.0, True, "answer '42'", answered=True)
    assert _judge("exact", "x =  42\t", "x = 42").correct  # whitespace runs collapse
    wrong = _judge("exact", "42\n43", "42")
    assert (wrong.reward, wrong.correct, wrong.reason) == (0.0, False, "answer '43', expected '42'")
    assert _judge("exact", "   ", "42").reason == "empty response"
    assert not _judge({"type": "exact", "compare": "whole"}, "so\n42", "42").correct
    assert _judge({"type": "exact", "compare": "whole"}, "the  answer\nis 42", "the answer is 42").correct
    assert not _judge("exact", "Yes", "yes").correct
    assert _judge({"type": "exact", "case_sensitive": False}, "Yes", "yes").correct


@pytest.mark.parametrize("response", [
    "The answer is 42.", "**42**", r"\boxed{42}", "42 apples", "So Tom has 42 apples left.", "$42$",
    "23 + 19 = 42", "Answer: 42\n\nCheck: 40 + 2 = 42", "The final answer is 42.0", r"The answer is \(42\).",
])
def test_math_accepts_any_clear_final_answer(response):
    v = V.math_verdict(response, "42")
    assert v.correct and v.reward == 1.0 and v.reason.startswith("parsed 42"), v


@pytest.mark.parametrize("response, reason, answered", [
    ("The answer is 41.", "parsed 41, expected 42", True),
    (r"\boxed{43}", "parsed 43, expected 42", True),
    ("I think it is forty-two", "no answer found", False),
    ("", "no answer found", False),
])
def test_math_rejects_wrong_or_missing_answers_and_says_what_it_read(response, reason, answered):
    assert V.math_verdict(response, "42") == Verdict(0.0, False, reason, answered=answered)


@pytest.mark.parametrize("response, reference", [
    ("21 / 9 + 96 / 9 = N", "13"),  # what GRPO on SmolLM2 learned to write: math-verify evaluated it to 13
    ("63 + 10 = N", "73"), ("The answer is 84/2.", "42"), (r"\boxed{6 \cdot 7}", "42"), ("The answer is 2*21", "42"), ("The answer is 1/4 + 1/4", "1/2"),
])
def test_math_wants_a_number_written_as_one_when_the_reference_is_a_number(response, reference):
    v = V.math_verdict(response, reference)
    assert not v.correct and v.answered is False and "an expression, not a number" in v.reason, v
    assert V.math_verdict(response, reference, literal_numbers=False).correct  # math-verify alone evaluates it


def test_math_references_as_written_or_as_latex():
    assert V.math_verdict("It costs 1000 dollars.", "1,000").correct
    assert V.math_verdict(r"So the result is \frac{1}{2}.", "0.5").correct
    assert V.math_verdict("The answer is $x^2+1$", "x^2+1").correct
    assert not V.math_verdict("The answer is $x^2+2$", "x^2+1").correct
    assert V.math_verdict("The answer is 1/2", r"\frac{1}{2}").correct
    assert V.parse_reference("42 apples") and not V.parse_reference("")
    assert V.math_verdict("42", "").reason == "reference '' is not parseable by math-verify"


def test_math_times_out_on_a_pathological_answer_instead_of_hanging():
    t0 = time.monotonic()
    v = V.math_verdict(r"The answer is \boxed{9^{9^{9^{9}}}}", "42", timeout_s=1, literal_numbers=False)
    assert time.monotonic() - t0 < 10
    assert (v.correct, v.reason) == (False, "parsed 9^{9^{9^{9}}}, comparing with 42 timed out (1 s)")


def test_math_off_the_main_thread_runs_in_a_child_process_that_is_killed_when_it_overruns():
    out = []
    worker = threading.Thread(target=lambda: out.append(V.math_verdict("The answer is 42.", "42")))
    worker.start()
    worker.join(120)
    assert out == [Verdict(1.0, True, "parsed 42", answered=True)]
    # a limit of 0.05 s: the child overruns and is killed (its process group with it); the next call gets a fresh one
    assert V._in_child(V._math_verdict_here, (r"\boxed{9^{9^{9^{9}}}}", "42", 1, False), 0.05, "timed out") == \
        Verdict(0.0, False, "timed out")
    assert V._in_child(V._math_verdict_here, ("The answer is 42.", "42", 1, True), 30, "timed out").correct


def test_a_batch_off_the_main_thread_is_one_child_call_with_the_main_threads_verdicts(monkeypatch):
    """math_verdicts on a reward actor's thread: the batch goes to the child in one call, verdict for verdict what
    the main thread computes; a batch that overruns its limit is verified again one by one."""
    pairs = [("The answer is 42.", "42"), ("So 41.", "42"), ("no number here", "42"), ("It is 84/2", "42"),
             ("Total: 1,000 dollars", "1,000")]
    want = V.math_verdicts(pairs)  # the main thread: no child
    assert [v.correct for v in want] == [True, False, False, False, True]
    calls = []
    real = V._in_child
    monkeypatch.setattr(V, "_in_child", lambda fn, args, *a, **k: calls.append(fn.__name__) or real(fn, args, *a, **k))
    out = []
    worker = threading.Thread(target=lambda: out.append(V.math_verdicts(pairs)))
    worker.start()
    worker.join(120)
    assert out == [want] and calls == ["_math_verdicts_here"]

    def overrun(fn, args, *a, **k):  # the batch's call times out; the per-sample calls run
        calls.append(fn.__name__)
        return Verdict(0.0, False, "timed out") if fn is V._math_verdicts_here else real(fn, args, *a, **k)

    monkeypatch.setattr(V, "_in_child", overrun)
    calls.clear()
    worker = threading.Thread(target=lambda: out.append(V.math_verdicts(pairs)))
    worker.start()
    worker.join(120)
    assert out[1] == want and calls == ["_math_verdicts_here"] + ["_math_verdict_here"] * len(pairs)


def test_the_built_math_verifier_verifies_a_batch_as_one_by_one():
    verifier = VERIFIER.validate_python(V.verifier_shorthand("math")).build()
    items = [(Trajectory.single(Problem(f"d:{i}", "d", "q", a), r), a, {}) for i, (r, a) in
             enumerate([("The answer is 7.", "7"), ("8", "7"), ("", "7")])]
    assert verifier.many(items) == [verifier(*item) for item in items]
    assert [v.correct for v in verifier.many(items)] == [True, False, False]


def test_regex_extracts_the_last_match_and_compares_it():
    spec = {"type": "regex", "pattern": r"#### *(\S+)"}
    assert _judge(spec, "#### 7\nwork\n#### 42", "42").correct
    assert _judge(spec, "no marker", "42") == Verdict(0.0, False, "no match of the pattern", answered=False)
    assert not _judge(spec, "#### 41", "42").correct
    named = {"type": "regex", "pattern": r"(?P<unit>km|m): (?P<answer>\d+)"}
    assert _judge(named, "m: 3 then km: 42", "42").correct
    assert _judge({"type": "regex", "pattern": r"ANSWER \S+", "ignore_case": True}, "answer yes", "Answer YES").correct
    as_math = {"type": "regex", "pattern": r"Result: (.*)", "compare": "math"}
    assert _judge(as_math, "Result: 84/2", "42").correct and not _judge(as_math, "Result: 41", "42").correct
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        VERIFIER.validate_python({"type": "regex", "pattern": "(("})
    with pytest.raises(ValidationError, match="pattern"):
        VERIFIER.validate_python(V.verifier_shorthand("regex"))


def test_shorthands_and_unknown_verifiers():
    assert V.verifier_shorthand("math") == {"type": "math"}
    assert V.verifier_shorthand("python:a.b:c") == {"type": "python", "function": "a.b:c"}
    assert V.verifier_shorthand({"type": "exact"}) == {"type": "exact"}
    with pytest.raises(ValueError, match="unknown verifier 'fuzzy'"):
        V.verifier_shorthand("fuzzy")


def test_python_reward_functions_are_checked_against_the_protocol():
    from tests.tasks import reward_fns as fns

    for fits in (fns.echo_length, fns.graded, fns.raises, fns.returns_none, lambda t, a, r: 1.0, lambda *args: 0):
        assert V.reward_function_problem(fits) is None, fits
    assert "does not accept (trajectory, answer, row)" in V.reward_function_problem(fns.two_args)
    assert V.reward_function_problem(fns.wrong_answer_type) == "parameter 'answer' is annotated int, but it receives a str"
    assert V.reward_function_problem(fns.returns_text) == "its return annotation is str, not Verdict | float | bool"
    assert V.reward_function_problem(fns.NOT_A_FUNCTION) == "is a int, not a function"
    with pytest.raises(ValidationError, match=r"reward function 'tests.tasks.reward_fns:two_args' does not fit RewardFunction"):
        VERIFIER.validate_python(V.verifier_shorthand("python:tests.tasks.reward_fns:two_args"))
    with pytest.raises(ValidationError, match="has no attribute 'nope'"):
        VERIFIER.validate_python(V.verifier_shorthand("python:tests.tasks.reward_fns:nope"))
    with pytest.raises(ValidationError, match="cannot import reward function module 'tests.tasks.missing'"):
        VERIFIER.validate_python(V.verifier_shorthand("python:tests.tasks.missing:f"))


def test_a_python_reward_function_that_hangs_is_stopped_and_the_next_call_works():
    """issue #13: every verifier call is bounded in wall time, off the main thread too (the reward workers'
    threads): the function runs in a child process killed past timeout_s."""
    import threading
    import time

    spec = {"type": "python", "function": "tests.tasks.reward_fns:hangs", "timeout_s": 1.5}
    _judge({**spec, "function": "tests.tasks.reward_fns:echo_length"}, "42", "42")  # the child is up
    out = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: out.append(_judge(spec, "x", "42")))
    worker.start()
    worker.join(30)
    assert out == [Verdict(0.0, False, "the reward function did not return within 1.5 s")]
    assert time.monotonic() - t0 < 10
    assert _judge({**spec, "function": "tests.tasks.reward_fns:echo_length"}, " 42 ", "42").correct  # a fresh child


def test_python_reward_function_results_become_verdicts():
    fn = "python:tests.tasks.reward_fns:"
    assert _judge(fn + "echo_length", " 42 ", "42") == Verdict(1.0, True, "reward function: True")
    assert _judge(fn + "echo_length", "about 40", "42", {"hint": "40"}) == Verdict(0.5, False, "reward function: 0.5")
    assert _judge({"type": "python", "function": "tests.tasks.reward_fns:echo_length", "correct_at": 0.5},
                  "about 40", "42", {"hint": "40"}).correct
    assert _judge(fn + "graded", "x", "42", {"q": "7"}) == Verdict(0.25, False, "graded 7")
    assert _judge(fn + "raises", "x", "42") == Verdict(0.0, False, "reward function error: RuntimeError: boom")
    assert _judge(fn + "returns_none", "x", "42") == Verdict(0.0, False, "the reward function returned None, not Verdict | float | bool")

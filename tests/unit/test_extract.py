"""The structured-output domain (rewards/extract.py, issue #43 domain c): its demonstrations are what its verifier
accepts, its verdicts check the schema before the values, and its held-out split is disjoint from every training
stream of the domain, with or without distractors."""

from __future__ import annotations

import json
import random
from itertools import islice

import pytest

from rewards.extract import KINDS, ExtractTask, find_object, judge
from rewards.task import Trajectory, VerifyContext
from rl.config import Recipe


def verdict(task: ExtractTask, problem, reply: str):
    return task.verify(Trajectory.single(problem, reply), VerifyContext())


@pytest.mark.parametrize("distractor", [False, True])
def test_every_demonstration_is_accepted_and_every_kind_appears(distractor):
    task = ExtractTask("x", distractor=distractor, num_heldout=300)
    problems = task.heldout() + list(islice(task.train_stream(), 300))
    assert {p.metadata["kind"] for p in problems} == set(KINDS)
    for p in problems:
        v = verdict(task, p, task.demonstration(p, random.Random(0)))
        assert (v.reward, v.correct, v.answered) == (1.0, True, True), (p.prompt, v)
        assert list(json.loads(p.answer)) == [k for k, _ in KINDS[p.metadata["kind"]].schema]
        assert p.prompt[0].role == "system" and all(f'"{k}"' in p.prompt[0].content for k, _ in KINDS[p.metadata["kind"]].schema)


def test_the_schema_is_checked_before_the_values():
    ref = {"name": "Ana Silva", "age": 34, "city": "Lyon", "job": "nurse"}
    good = judge(dict(ref), "person", ref)
    assert good.correct and good.reward == 1.0
    missing = judge({k: v for k, v in ref.items() if k != "age"}, "person", ref)
    assert (missing.reward, missing.correct, missing.answered) == (0.0, False, True) and "missing age" in missing.reason
    extra = judge({**ref, "email": "a@b.org"}, "person", ref)
    assert extra.reward == 0.0 and "extra email" in extra.reason
    digits_as_text = judge({**ref, "age": "34"}, "person", ref)
    assert digits_as_text.reward == 0.0 and "age is str, not integer" in digits_as_text.reason
    a_bool = judge({**ref, "age": True}, "person", ref)
    assert a_bool.reward == 0.0
    one_wrong = judge({**ref, "city": "Oslo"}, "person", ref)
    assert (one_wrong.reward, one_wrong.correct) == (0.75, False) and "city" in one_wrong.reason
    padded = judge({**ref, "job": "  nurse "}, "person", ref)
    assert padded.correct
    assert not judge({**ref, "job": "Nurse"}, "person", ref).correct  # case is kept


@pytest.mark.parametrize("reply", [
    '{"name": "Ana Silva", "age": 34, "city": "Lyon", "job": "nurse"}',
    '```json\n{"name": "Ana Silva", "age": 34, "city": "Lyon", "job": "nurse"}\n```',
    'Here it is: {"name": "Ana Silva", "age": 34, "city": "Lyon", "job": "nurse"} Done.',
])
def test_the_object_is_found_in_a_plain_fenced_or_wrapped_reply(reply):
    assert find_object(reply) == {"name": "Ana Silva", "age": 34, "city": "Lyon", "job": "nurse"}


@pytest.mark.parametrize("reply", ["", "name: Ana", "[1, 2]", '{"name": "Ana"', "{" * 5000 + "}" * 5000])
def test_a_reply_without_an_object_scores_zero_and_is_not_answered(reply):
    task = ExtractTask("x", kinds=["person"], num_heldout=5)
    v = verdict(task, task.heldout()[0], reply)
    assert (v.reward, v.correct, v.answered) == (0.0, False, False)


def test_held_out_subjects_never_train_in_any_dataset_of_the_domain():
    held = {p.metadata["core"] for d in (False, True) for p in ExtractTask("h", distractor=d, num_heldout=400).heldout()}
    for distractor in (False, True):
        for seed, offset in ((0, 0), (1, 3)):
            task = ExtractTask(f"t{seed}", distractor=distractor, seed=seed)
            assert not held & {p.metadata["core"] for p in islice(task.train_stream(offset), 3000)}


def test_problems_are_reproducible_and_ids_distinct():
    a, b = ExtractTask("x", num_heldout=1000), ExtractTask("x", num_heldout=1000)
    assert [p.problem_id for p in a.heldout()] == [p.problem_id for p in b.heldout()]
    assert len({p.problem_id for p in a.heldout()}) == 1000
    assert [p.answer for p in islice(a.train_stream(2), 50)] == [p.answer for p in islice(b.train_stream(2), 50)]
    assert [p.answer for p in islice(a.train_stream(2), 50)] != [p.answer for p in islice(a.train_stream(3), 50)]


def test_a_recipe_names_it_and_bad_arguments_are_one_line():
    recipe = Recipe.model_validate({
        "datasets": [{"type": "custom", "name": "ex_person", "task": "rewards.extract:ExtractTask",
                      "args": {"kinds": ["person"], "distractor": True}}],
        "stages": [{"type": "sft", "max_steps": 1}]})
    assert recipe.datasets[0].args["kinds"] == ["person"]
    with pytest.raises(ValueError, match="unknown kinds \\['people'\\]"):
        ExtractTask("x", kinds=["people"])

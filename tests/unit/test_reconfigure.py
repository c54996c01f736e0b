"""Live reconfiguration, pure parts: patch parsing, validation against the live config, versioning,
the inbox/answer file channel."""

from __future__ import annotations

import pytest

from model.config import ModelConfig
from rl import reconfigure as rc
from teachers.config import TeacherSpec

DATASETS = ["arith", "reverse", "sort"]


def live() -> rc.LiveConfig:
    teachers = {n: TeacherSpec(name=n, checkpoint=f"/nonexistent/{n}") for n in ("t0", "t1", "t2")}
    return rc.LiveConfig(version=3, mixture={"arith": 1.0}, caps={"reverse": 8},
                         assignment={"arith": "t0", "reverse": "t1", "sort": "t1"}, teachers=teachers)


def teacher_dir(tmp_path, name: str, vocab: int = 99):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(ModelConfig(vocab_size=vocab).model_dump_json())
    return d


def test_apply_creates_the_next_version_and_leaves_the_old_one_untouched():
    old = live()
    patch = rc.parse_patch("mixture: {reverse: 3}\ndataset_max_inflight: {reverse: null, sort: 4}\nteachers: {sort: t2}\n")
    new = rc.apply_patch(old, patch, DATASETS, 99, train_step=17)
    assert new.version == 4 and old.version == 3
    assert new.mixture == {"arith": 1.0, "reverse": 3.0} and new.caps == {"sort": 4}
    assert new.assignment == {"arith": "t0", "reverse": "t1", "sort": "t2"} and old.assignment["sort"] == "t1"
    assert new.active_teachers == {"t0", "t1", "t2"}
    assert new.history[-1]["version"] == 4 and new.history[-1]["train_step"] == 17
    # removing a teacher = assigning its datasets elsewhere: it leaves the active set
    newer = rc.apply_patch(new, rc.parse_patch("", overrides=["teachers.reverse=t0", "teachers.sort=t0"]), DATASETS, 99, 18)
    assert newer.active_teachers == {"t0"} and newer.version == 5


@pytest.mark.parametrize("text, overrides, message", [
    ("mixture: {nope: 1}", [], "mixture names unknown datasets ['nope']"),
    ("mixture: {arith: -1}", [], "mixture weights must be >= 0"),
    ("mixture: {arith: 0, reverse: 0, sort: 0}", [], "every dataset would have weight 0"),
    ("dataset_max_inflight: {sort: 0}", [], "dataset_max_inflight.sort must be > 0 or null"),
    ("teachers: {sort: t9}", [], "teachers.sort: unknown teacher 't9'"),
    ("bogus: 1", [], "bogus: Extra inputs are not permitted"),
    ("mixture: [1, 2]", [], "mixture: Input should be a valid dictionary"),
    ("mixture: {arith: 1", [], "not valid YAML"),
    ("", ["mixture.arith"], "expected KEY=VALUE"),
])
def test_bad_patches_are_refused_with_one_line_and_change_nothing(text, overrides, message):
    old = live()
    with pytest.raises(rc.ReconfigError) as err:
        rc.apply_patch(old, rc.parse_patch(text, overrides=overrides), DATASETS, 99, 0)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert old == live()


def test_added_teachers_are_checked_against_the_student_vocabulary(tmp_path):
    good = TeacherSpec(name="t9", checkpoint=teacher_dir(tmp_path, "t9"), datasets=[])
    bad = TeacherSpec(name="t8", checkpoint=teacher_dir(tmp_path, "t8", vocab=120))
    patch = rc.ReconfigPatch(add_teachers=[good], teachers={"sort": "t9"})
    new = rc.apply_patch(live(), patch, DATASETS, 99, 0)
    assert new.teacher_for("sort") == "t9" and "t9" in new.teachers
    with pytest.raises(rc.ReconfigError, match="vocab_size=120 but the student has vocab_size=99"):
        rc.apply_patch(live(), rc.ReconfigPatch(add_teachers=[bad]), DATASETS, 99, 0)
    with pytest.raises(rc.ReconfigError, match="already exists"):
        rc.apply_patch(live(), rc.ReconfigPatch(add_teachers=[good.model_copy(update={"name": "t0"})]), DATASETS, 99, 0)
    with pytest.raises(rc.ReconfigError, match="no: no such file or directory"):
        rc.apply_patch(live(), rc.ReconfigPatch(add_teachers=[TeacherSpec(name="tx", checkpoint=tmp_path / "no")]),
                       DATASETS, 99, 0)


def test_inbox_and_answers(tmp_path):
    pid = rc.submit(tmp_path, rc.parse_patch("mixture: {arith: 2}"))
    (entry_id, path), = rc.pending(tmp_path)
    assert entry_id == pid and rc.parse_patch(path.read_text()).mixture == {"arith": 2.0}
    assert rc.wait_answer(tmp_path, pid, 0.05) is None
    rc.answer(tmp_path, pid, {"status": "applied", "version": 1})
    assert rc.pending(tmp_path) == [] and rc.wait_answer(tmp_path, pid, 1.0) == {"status": "applied", "version": 1}
    assert rc.answers(tmp_path) == [{"status": "applied", "version": 1}]


def test_a_new_version_leaves_the_previous_versions_history_as_it_was():
    old = live()
    new = rc.apply_patch(old, rc.parse_patch("mixture: {reverse: 3}"), DATASETS, 99, train_step=17)
    newer = rc.apply_patch(new, rc.parse_patch("mixture: {sort: 2}"), DATASETS, 99, train_step=18)
    assert old.history == [] and [h["version"] for h in new.history] == [4]
    assert [h["version"] for h in newer.history] == [4, 5]

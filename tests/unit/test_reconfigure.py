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


# -- issue 40, class 2: what the running stage refuses (rl/algo/async_grpo.py `validated` passes these) ----------
@pytest.mark.parametrize("text, kwargs, message", [
    # each weight is finite, their total is not: random.choices raised inside the job
    ("mixture: {arith: 1.0e+308, reverse: 1.0e+308}", {}, "mixture: the weights' total is not finite"),
    ("dataset_max_inflight: {sort: 3}", {"group_size": 4}, "dataset_max_inflight.sort=3 is below the group size 4"),
    # reverse keeps its recipe cap of 8, below a group of 16, and the others weigh 0: the rollout stalled
    ("mixture: {arith: 0, sort: 0}", {"group_size": 16}, "nothing could be dispatched"),
    ("teachers: {sort: t0}", {"opd": False}, "the running stage is not an OPD stage"),
])
def test_the_running_stage_refuses_what_it_could_not_run(text, kwargs, message):
    old = live()
    with pytest.raises(rc.ReconfigError) as err:
        rc.apply_patch(old, rc.parse_patch(text), DATASETS, 99, 0, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert old == live()


def test_rules_the_cli_cannot_judge_wait_for_the_job():
    """`rl reconfigure` checks against the whole recipe, without a stage's group size or kind: it lets these through."""
    for text in ("dataset_max_inflight: {sort: 3}", "teachers: {sort: t0}", "mixture: {arith: 0, sort: 0}"):
        rc.check_patch(live(), rc.parse_patch(text), DATASETS, 99)
    new = rc.apply_patch(live(), rc.parse_patch("dataset_max_inflight: {sort: 4}"), DATASETS, 99, 0, group_size=4, opd=True)
    assert new.caps == {"reverse": 8, "sort": 4}


def test_in_flight_samples_keep_their_teacher_while_it_is_active():
    """DESIGN/rl/reconfigure.py: a remapped dataset's in-flight samples are scored by the teacher they were dispatched
    with while it still scores some dataset; once it left the active set, by their dataset's teacher now."""
    remapped = rc.apply_patch(live(), rc.parse_patch("teachers: {sort: t2}"), DATASETS, 99, 0)
    assert remapped.scoring_teacher("t1", "sort") == "t1"  # t1 still scores reverse
    gone = rc.apply_patch(remapped, rc.parse_patch("teachers: {reverse: t2}"), DATASETS, 99, 0)
    assert gone.scoring_teacher("t1", "sort") == "t2" and gone.scoring_teacher("t1", "reverse") == "t2"
    assert gone.scoring_teacher("t0", "arith") == "t0" and gone.scoring_teacher(None, "arith") == "t0"


def test_a_claimed_patch_leaves_the_inbox_until_it_is_answered(tmp_path):
    """The job claims a patch before validating it: if it dies validating, the resumed job finds it claimed (and
    refuses it) instead of loading it again from the inbox."""
    pid = rc.submit(tmp_path, rc.parse_patch("mixture: {arith: 2}"))
    (rc.inbox(tmp_path) / "junk.json").mkdir()  # not a patch: never listed, never claimed
    path = rc.claim(tmp_path, pid)
    assert rc.pending(tmp_path) == [] and rc.claimed(tmp_path) == [(pid, path)]
    assert rc.parse_patch(path.read_text()).mixture == {"arith": 2.0}
    rc.answer(tmp_path, pid, {"status": "refused", "reason": "r"})
    assert rc.claimed(tmp_path) == [] and rc.answers(tmp_path) == [{"status": "refused", "reason": "r"}]
    other = rc.submit(tmp_path, rc.parse_patch("mixture: {arith: 3}"))
    assert rc.withdraw(tmp_path, other) and rc.pending(tmp_path) == [] and not rc.withdraw(tmp_path, other)


def test_the_dispatcher_takes_only_a_config_a_recipe_could_hold():
    """Dispatcher.reconfigure validates like a recipe's DispatchConfig (it copied the weights in unchecked, and a
    weight a draw cannot take killed the job at its next draw); a refusal leaves the dispatcher as it was."""
    from pydantic import ValidationError

    from rl.dispatch import DispatchConfig, Dispatcher

    d = Dispatcher(DispatchConfig(max_inflight=8), datasets=["a", "b"], group_size=2, prompts_per_step=1)
    for mixture, caps in (({"a": 1e308, "b": 1e308}, {}), ({"a": -1.0}, {}), ({"a": float("nan")}, {}), ({}, {"a": 0})):
        with pytest.raises(ValidationError):
            d.reconfigure(mixture, caps)
        assert d.cfg == DispatchConfig(max_inflight=8)
    d.reconfigure({"a": 3.0}, {"b": 2})
    assert d.cfg.mixture == {"a": 3.0} and d.cfg.dataset_max_inflight == {"b": 2} and d.dispatch()
    with pytest.raises(ValidationError, match="total must be finite"):
        DispatchConfig(mixture={"a": 1e308, "b": 1e308})


def _teacher(tmp_path, name: str, damage: str | None = None) -> TeacherSpec:
    import torch

    from model.checkpoint import save_checkpoint
    from model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=99, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8))
    if damage == "inf":
        with torch.no_grad():
            model.lm_head.weight[0, 0] = float("inf")
    save_checkpoint(model, tmp_path / name)
    weights = tmp_path / name / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    if damage == "missing":
        weights.unlink()
    return TeacherSpec(name=name, checkpoint=tmp_path / name)


@pytest.mark.parametrize("damage, message", [
    ("truncated", "teacher 'bad': cannot read"), ("missing", "teacher 'bad': cannot read"),
    ("inf", "teacher 'bad' checkpoint"),
])
def test_the_teacher_pool_refuses_damaged_weights_with_one_line_and_stays_as_it_was(tmp_path, damage, message):
    """The job loads a patch's teachers to validate it: a damaged weights file raised safetensors' own error (the job
    died); non-finite weights loaded silently and made every KL NaN."""
    from teachers.pool import TeacherPool

    pool = TeacherPool([_teacher(tmp_path, "good")], device_memory_mib=1.0)
    with pytest.raises(ValueError) as err:
        pool.add(_teacher(tmp_path, "bad", damage))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert damage != "inf" or "non-finite weights in lm_head.weight" in str(err.value)
    assert pool.names == ["good"]
    pool.add(_teacher(tmp_path, "bad2"))
    assert pool.names == ["good", "bad2"]
    pool.close()


def test_a_cap_below_what_is_in_flight_drops_nothing_and_waits_for_room():
    """A cap lowered under a dataset's in-flight samples is accepted: those samples run on (none is dropped) and the
    dataset is drawn again only once a group fits under the cap."""
    from rl.dispatch import DispatchConfig, Dispatcher, FinishedMeta

    d = Dispatcher(DispatchConfig(max_inflight=12, mixture={"b": 0.0}), datasets=["a", "b"], group_size=2,
                   prompts_per_step=1)
    tickets = d.dispatch()
    assert len(tickets) == 6 and d.inflight["a"] == 12
    d.reconfigure({"b": 1.0}, {"a": 4})
    for j in range(2):
        d.on_finished(FinishedMeta(f"{tickets[0].prompt_id}-{j}", tickets[0].prompt_id, 3, 0))
    assert d.inflight["a"] == 10 and [t.dataset for t in d.dispatch()] == ["b"]  # a: 10 + 2 > 4
    for t in tickets[1:5]:
        for j in range(2):
            d.on_finished(FinishedMeta(f"{t.prompt_id}-{j}", t.prompt_id, 3, 0))
    assert d.inflight["a"] == 2 and d.num_ready_groups == 5  # every group that was in flight completed
    d.reconfigure({"b": 0.0}, {"a": 4})  # only a may be drawn now (b's prompt drawn but not admitted is dropped)
    assert [t.dataset for t in d.dispatch()] == ["a"] and d.inflight["a"] == 4  # room for one group again, no more

"""What a rollback to a checkpoint's watermark does to the tables the basic test (test_checkpoint.py) does not
look at: config versions, outcomes, a store reopened by a restarted job, and other runs sharing the database.
Real SQLite files."""

from __future__ import annotations

import sqlite3

import pytest

from rl.store.trajectories import TrajectoryStore, Watermark
from rl.types import Prompt
from tests.unit.test_store import make_sample


def _prompt(pid: str) -> Prompt:
    return Prompt(pid, "arith", "1+1=", (1, 20), "2", group_size=2, policy_version=0)


def _outcomes(path, run_id: str) -> dict[str, str | None]:
    with sqlite3.connect(path) as c:
        return dict(c.execute("select prompt_id, outcome from prompts where run_id = ?", (run_id,)))


@pytest.fixture
def store(tmp_path):
    s = TrajectoryStore.for_run_dir(tmp_path / "run")
    yield s
    s.close()


def test_rollback_removes_applied_config_versions_after_the_watermark_and_a_reapplied_patch_shows_once(store):
    store.add_prompts([_prompt("p0")])
    store.add_config_version(1, "applied", {"mixture": {"arith": 2.0}}, train_step=0)
    store.add_config_version(None, "refused", {}, train_step=0, reason="mixture names unknown datasets")
    wm = store.watermark(0)
    store.add_config_version(2, "applied", {"dataset_max_inflight": {"arith": 8}}, train_step=1)  # after the checkpoint
    store.add_config_version(None, "refused", {"teachers": {"arith": "t9"}}, train_step=1, reason="unknown teacher")
    kept = store.config_versions()[:2] + store.config_versions()[3:]
    store.rollback_to(wm, checkpoint="ckpt")
    assert store.config_versions() == kept  # a refused patch is answered and never retried: its row stays
    # the restored controller applies the answered patch again: the table shows it once
    store.add_config_version(2, "applied", {"dataset_max_inflight": {"arith": 8}}, train_step=1)
    assert [(r["version"], r["status"]) for r in store.config_versions()] == [
        (1, "applied"), (None, "refused"), (None, "refused"), (2, "applied")]


def test_a_reopened_store_continues_after_its_last_config_version(tmp_path):
    """A job restarted right after a reconfiguration takes its watermarks after that row, so rolling back to
    one keeps the row."""
    first = TrajectoryStore.for_run_dir(tmp_path / "run")
    first.add_prompts([_prompt("p0")])
    first.add_config_version(1, "applied", {"mixture": {"arith": 2.0}}, train_step=0)
    first.close()
    again = TrajectoryStore.for_run_dir(tmp_path / "run")
    again.rollback_to(again.watermark(0), checkpoint="ckpt")
    assert [r["version"] for r in again.config_versions()] == [1]
    again.close()


def test_rollback_reopens_outcomes_recorded_after_the_watermark(store, tmp_path):
    store.add_prompts([_prompt("p0"), _prompt("p1"), _prompt("p2")])
    store.set_outcome(["p0"], "trained")
    wm = store.watermark(1)
    store.set_outcome(["p1"], "dropped_stale")  # after the checkpoint: the restored job decides again
    store.add_prompts([_prompt("p3")])
    store.set_outcome(["p3"], "discarded")
    store.rollback_to(wm, checkpoint="ckpt")
    assert _outcomes(tmp_path / "run" / "trajectories.db", store.run_id) == {"p0": "trained", "p1": None, "p2": None}
    assert store.audit()["prompts_open"] == 2


def test_an_outcome_is_final(store, tmp_path):
    store.add_prompts([_prompt("p0"), _prompt("p1")])
    store.set_outcome(["p0"], "trained")
    store.set_outcome(["p0", "p1"], "dropped_stage_end")
    assert _outcomes(tmp_path / "run" / "trajectories.db", store.run_id) == {"p0": "trained", "p1": "dropped_stage_end"}


def _fill(store: TrajectoryStore) -> None:
    """The same ids in every run: a prompt, two samples, one trained, a config version, outcomes."""
    store.add_prompts([_prompt("p0")])
    store.add_samples([make_sample("s0", prompt_id="p0"), make_sample("s1", prompt_id="p0")])
    store.mark_trained(["s0"], 1)
    store.add_train_step(1, {"rl/loss": 0.5})
    store.add_config_version(1, "applied", {"mixture": {"arith": 2.0}}, train_step=1)


def test_rollback_and_outcomes_of_one_run_leave_another_run_in_the_same_database_alone(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    a, b = TrajectoryStore(url, "run-a"), TrajectoryStore(url, "run-b")
    _fill(b)
    _fill(a)
    a.add_samples([make_sample("s2", prompt_id="p0")])
    a.set_outcome(["p0"], "dropped_stage_end")  # a's p0, not b's (still open)
    b.set_outcome(["p0"], "trained")
    a.rollback_to(Watermark(0, 0), checkpoint="")  # a starts over
    assert a.count_samples() == 0 and a.config_versions() == [] and a.train_step_metrics(1) is None
    assert b.count_samples() == 2 and b.sample_train_step("s0") == 1 and b.train_step_metrics(1) == {"rl/loss": 0.5}
    assert [r["version"] for r in b.config_versions()] == [1] and b.segments("s1") != []
    assert _outcomes(tmp_path / "shared.db", "run-b") == {"p0": "trained"}
    assert b.audit() == {"trained_twice": 0, "trained": 1, "link_mismatch": 0, "prompts": 1, "prompts_open": 0}
    a.close(), b.close()

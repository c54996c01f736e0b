"""A run's identity in a shared store (issue #40, class 6): a copy of a run directory that fell behind is refused
instead of rolling the run back, unless it asks for a new identity; a move, a kill between a store write and the
next checkpoint, and a damaged newest checkpoint resume as before. A real store shared by two run directories (a
SQLite file outside both, or a PostgreSQL database), stand-in checkpoints with complete controller records
(tests/unit/test_checkpoint_rules.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import MetaData, create_engine, select

from rl.algo.resume import find_resume_point, record_lineage
from rl.checkpoint.format import CheckpointError, CheckpointManager
from rl.store.identity import LINEAGE_KEEP, add_checkpoint_token, checkpoint_tokens, read_run_file
from rl.store.trajectories import TrajectoryStore
from tests.unit.test_checkpoint_rules import _checkpoint, _recipe
from tests.unit.test_store import make_sample
from tests.unit.test_store_postgres import TABLES, shared_url  # noqa: F401 (a fixture: SQLite and PostgreSQL)


def dump(url) -> dict[str, list]:
    """Every row of every table, every column, bytes included."""
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=TABLES)
    with engine.connect() as conn:
        out = {t: sorted(conn.execute(select(meta.tables[t])).all(), key=repr) for t in TABLES}
    engine.dispose()
    return out


class Run:
    """A run directory writing to the shared store: samples, train steps and checkpoints as a job records them."""

    def __init__(self, run_dir: Path, url):
        self.dir, self.url = run_dir, url
        self.store = TrajectoryStore.for_run_dir(run_dir, url=url)
        self.manager = CheckpointManager(run_dir / "checkpoints", keep_last=10, warn=lambda m: None)

    def step(self, step: int) -> None:
        """One train step: two new samples, the older untrained ones trained by it."""
        fresh = [make_sample(f"s{step}-{i}") for i in range(2)]
        self.store.add_samples(fresh)
        self.store.mark_trained([f"s{step}-{i}" for i in range(2)], step)
        self.store.add_train_step(step, {"rl/loss": float(step)})

    def checkpoint(self, step: int) -> Path:
        path = _checkpoint(self.manager, _recipe(), self.store.watermark(step), step=step)
        record_lineage(self.dir, self.store, path, step)
        return path

    def resume(self, **kw):
        return find_resume_point(_recipe(), self.store, self.manager, say=lambda m: None, run_dir=self.dir, **kw)


@pytest.fixture
def shared(shared_url):  # noqa: F811
    return shared_url


def _original_with_a_copy_that_fell_behind(tmp_path, shared) -> tuple[Run, Path]:
    a = Run(tmp_path / "a", shared)
    for step in (1, 2):
        a.step(step)
    a.checkpoint(2)
    shutil.copytree(a.dir, tmp_path / "b")  # the copy: run.json and checkpoints up to step 2
    for step in (3, 4):
        a.step(step)
    a.checkpoint(4)
    a.step(5)
    a.store.close()
    return a, tmp_path / "b"


def test_a_copy_that_fell_behind_is_refused_and_the_store_kept(tmp_path, shared):
    a, b_dir = _original_with_a_copy_that_fell_behind(tmp_path, shared)
    before = dump(shared)
    b = Run(b_dir, shared)
    assert b.store.run_id == a.store.run_id  # the identity travelled with the copy
    with pytest.raises(CheckpointError) as e:
        b.resume()
    msg = str(e.value)
    assert "\n" not in msg and "up to train step 5" in msg and "step-00000004-000" in msg
    assert msg.endswith(f"rl resume {b_dir} --new-identity") and "newest checkpoint is step-00000002-000" in msg
    b.store.close()
    assert dump(shared) == before  # not one row rolled back


def test_the_original_still_resumes_after_its_copy_was_refused(tmp_path, shared):
    a, b_dir = _original_with_a_copy_that_fell_behind(tmp_path, shared)
    with pytest.raises(CheckpointError):
        Run(b_dir, shared).resume()
    a = Run(a.dir, shared)
    point = a.resume()
    assert point.global_step == 4 and a.store.last_train_step() == 4  # step 5 (after its checkpoint) is redone
    a.store.close()


def test_a_copy_resumed_with_a_new_identity_is_a_run_of_its_own(tmp_path, shared):
    a, b_dir = _original_with_a_copy_that_fell_behind(tmp_path, shared)
    original = dump(shared)
    b = Run(b_dir, shared)
    old = b.store.run_id
    point = b.resume(new_identity=True)
    assert point.global_step == 2
    new = read_run_file(b_dir)
    assert new != old and b.store.run_id == new
    record = json.loads((b_dir / "run.json").read_text())
    assert record["forked_from"] == {"run_id": old, "train_step": 2} and record["checkpoint_tokens"] == []
    # its history up to the checkpoint: the same samples, trained by the same steps
    assert sorted(r.sample_id for r in b.store.query(limit=100)) == ["s1-0", "s1-1", "s2-0", "s2-1"]
    assert b.store.sample_train_step("s2-1") == 2 and b.store.count_train_steps() == 2
    assert b.store.audit()["link_mismatch"] == 0
    b.step(3)  # it goes on under its own id; the original's rows are untouched
    b.checkpoint(3)
    b.store.close()
    after = dump(shared)
    assert {t: [r for r in rows if old in r] for t, rows in after.items()} == \
        {t: [r for r in rows if old in r] for t, rows in original.items()}
    b = Run(b_dir, shared)  # and resumes as itself, without the option
    assert b.resume().global_step == 3
    b.store.close()
    a = Run(a.dir, shared)  # so does the original
    assert a.resume().global_step == 4
    a.store.close()


def test_a_moved_run_directory_resumes(tmp_path, shared):
    a = Run(tmp_path / "a", shared)
    a.step(1)
    a.checkpoint(1)
    a.step(2)  # killed after this step's store writes, before its checkpoint: the ordinary rollback case
    a.store.close()
    moved = tmp_path / "elsewhere" / "a"
    shutil.move(a.dir, moved)
    m = Run(moved, shared)
    assert m.resume().global_step == 1 and m.store.last_train_step() == 1
    m.store.close()


def test_a_kill_between_run_json_and_the_store_row_still_resumes(tmp_path, shared):
    a = Run(tmp_path / "a", shared)
    a.step(1)
    a.checkpoint(1)
    a.step(2)
    path = _checkpoint(a.manager, _recipe(), a.store.watermark(2), step=2)
    add_checkpoint_token(a.dir, "f" * 32)  # record_lineage's first half; the store never got its row
    assert a.resume().path == path
    a.store.close()


def test_a_removed_newest_checkpoint_of_the_directorys_own_lineage_rolls_back_as_before(tmp_path, shared):
    a = Run(tmp_path / "a", shared)
    for step in (1, 2):
        a.step(step)
        newest = a.checkpoint(step)
    shutil.rmtree(newest)
    assert a.resume().global_step == 1 and a.store.last_train_step() == 1
    a.store.close()


def test_run_json_keeps_the_newest_tokens_and_refuses_damaged_ones(tmp_path, shared):
    a = Run(tmp_path / "a", shared)
    for i in range(LINEAGE_KEEP + 3):
        add_checkpoint_token(a.dir, f"t{i}")
    assert checkpoint_tokens(a.dir) == [f"t{i}" for i in range(3, LINEAGE_KEEP + 3)]
    record = json.loads((a.dir / "run.json").read_text())
    (a.dir / "run.json").write_text(json.dumps({**record, "checkpoint_tokens": [1, 2]}))
    from rl.store.db import StoreError

    with pytest.raises(StoreError, match="checkpoint_tokens"):
        checkpoint_tokens(a.dir)
    a.store.close()

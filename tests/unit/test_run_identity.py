"""A run's identity (RUN_DIR/run.json) and its store's location, on real SQLite files: copied and
renamed runs keep their identity, older run directories keep the id their store used, awkward
directory names keep the database inside the run directory."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
import yaml

from rl.cli import main
from rl.store.identity import read_run_identity, run_identity
from rl.store.trajectories import StoreError, TrajectoryStore, recorded_train_steps
from rl.store.db import sqlite_url
from tests.unit.test_store import make_sample
from tests.unit.test_store_migrations import legacy_run


def _write_run(run_dir, sample_id="s1-p0000000-0", reward=1.0):
    store = TrajectoryStore.for_run_dir(run_dir, name="exp")
    store.add_run("exp", "{}")
    store.add_samples([make_sample(sample_id, reward=reward)])
    store.add_train_step(1, {"rl/loss": 0.5})
    store.close()
    return store.run_id


def test_run_json_is_written_once_and_read_after(tmp_path):
    run_dir = tmp_path / "run"
    run_id = _write_run(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["run_id"] == run_id and str(uuid.UUID(run_id)) == run_id and record["name"] == "exp"
    assert record["created_at"] > 0
    assert run_identity(run_dir) == run_id and json.loads((run_dir / "run.json").read_text()) == record
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    assert _write_run(tmp_path / "other") != run_id  # a new directory is a new run


@pytest.mark.parametrize("how", ["renamed", "copied"])
def test_a_renamed_or_copied_run_keeps_its_identity(tmp_path, capsys, how):
    run_dir = tmp_path / "run"
    run_id = _write_run(run_dir)
    moved = run_dir.rename(tmp_path / "moved") if how == "renamed" else shutil.copytree(run_dir, tmp_path / "copy")
    store = TrajectoryStore.for_run_dir(moved)  # the writer (e.g. `rl resume`) finds the same run
    assert store.run_id == run_id and store.count_samples() == 1
    store.close()
    reader = TrajectoryStore.read_run(moved)
    assert reader.run_id == run_id and [r.sample_id for r in reader.query()] == ["s1-p0000000-0"]
    reader.close()
    assert recorded_train_steps(moved) == 1


def test_an_old_run_directory_keeps_the_id_its_store_used(tmp_path):
    run_dir = legacy_run(tmp_path, "d07e8ae")  # the old code's run id is the directory's name
    main(["db", "upgrade", str(run_dir)])
    assert read_run_identity(run_dir, ["store-d07e8ae"], own_store=True) == "store-d07e8ae"
    renamed = run_dir.rename(tmp_path / "renamed")  # its own file holds one run: that one
    assert TrajectoryStore.read_run(renamed).run_id == "store-d07e8ae"
    (renamed / "recipe.yaml").write_text("run: {name: legacy}\n")
    assert run_identity(renamed) == "store-d07e8ae"  # the writer records it in run.json
    assert json.loads((renamed / "run.json").read_text())["run_id"] == "store-d07e8ae"


def test_a_new_directory_never_takes_an_existing_runs_name_in_a_shared_store(tmp_path):
    shared = tmp_path / "shared.db"
    other = TrajectoryStore(sqlite_url(shared), "exp")  # an old-style id equal to a directory name
    other.add_run("exp", "{}")
    other.close()
    store = TrajectoryStore.for_run_dir(tmp_path / "exp", url=sqlite_url(shared))  # no recipe.yaml: new run
    assert store.run_id != "exp"
    store.close()


def test_a_reader_refuses_to_guess_among_many_runs(tmp_path):
    run_dir = tmp_path / "x"
    run_dir.mkdir()
    for rid in ("a", "b"):
        s = TrajectoryStore(sqlite_url(run_dir / "trajectories.db"), rid)
        s.add_run(rid, "{}")
        s.close()
    with pytest.raises(StoreError, match="no run.json and its store holds 2 other runs"):
        TrajectoryStore.read_run(run_dir)


@pytest.mark.parametrize("content", ["{not json", '{"name": "x"}', '{"run_id": 7}', '["run_id"]', "\udcff"])
def test_a_damaged_run_json_is_one_line(tmp_path, capsys, content):
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    (run_dir / "run.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(StoreError, match="run.json"):
        TrajectoryStore.for_run_dir(run_dir)
    assert main(["traj", "ls", str(run_dir)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "run.json" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["what?x=1", "a%41b", "hash#tag", "sp ace"])
def test_awkward_directory_names_keep_the_store_inside_the_run(tmp_path, capsys, name):
    run_dir = tmp_path / name
    _write_run(run_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written beside the run directory
    assert (run_dir / "trajectories.db").is_file()
    assert recorded_train_steps(run_dir) == 1
    assert main(["traj", "ls", str(run_dir)]) == 0 and "1 samples shown" in capsys.readouterr().out
    assert main(["db", "upgrade", str(run_dir)]) == 0 and "already at 0008" in capsys.readouterr().out


def test_recorded_train_steps_counts_this_run_only(tmp_path):
    shared = sqlite_url(tmp_path / "shared.db")
    assert recorded_train_steps(tmp_path / "a", url=shared) == 0  # nothing there yet
    a = TrajectoryStore.for_run_dir(tmp_path / "a", url=shared)
    b = TrajectoryStore.for_run_dir(tmp_path / "b", url=shared)
    for step in (1, 2, 3):
        a.add_train_step(step, {})
    b.add_train_step(1, {})
    assert recorded_train_steps(tmp_path / "a", url=shared) == 3 and recorded_train_steps(tmp_path / "b", url=shared) == 1
    (tmp_path / "a" / "recipe.yaml").write_text(yaml.safe_dump({"store": {"url": shared.render_as_string()}}))
    assert recorded_train_steps(tmp_path / "a") == 3  # the recipe's store.url
    a.close(), b.close()

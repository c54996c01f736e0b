"""Store schema versions on real SQLite files: the baseline is d07e8ae's schema, stores written by
d07e8ae and by a commit before the `effort` column (tests/fixtures/) upgrade with every row kept,
readers refuse old stores without touching them, an upgrade is atomic and runs under the lock."""

from __future__ import annotations

import fcntl
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from rl.cli import main
from rl.store.trajectories import StoreError, TrajectoryStore, decode_array
from rl.store.db import alembic_config, head_revision, schema_state, sqlite_url, upgrade_store
from tests.unit.test_store import make_sample

HEAD = "0008"
"""The newest schema revision (rl/store/migrations/versions)."""

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LEGACY = {"d07e8ae": FIXTURES / "store-d07e8ae.db", "pre-effort": FIXTURES / "store-pre-effort.db"}
OLD_TABLES = ("runs", "prompts", "samples", "train_steps", "trained", "config_versions", "restarts")


def schema(conn) -> dict:
    """Every table but alembic's: columns (type, nullable), key, references and indexes, by name (but expression
    indexes, which SQLAlchemy does not reflect on SQLite: checked apart)."""
    import warnings

    warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index")
    insp = inspect(conn)
    out = {}
    for t in sorted(set(insp.get_table_names()) - {"alembic_version"}):
        pk = insp.get_pk_constraint(t)
        out[t] = {
            "columns": {c["name"]: (str(c["type"]), c["nullable"]) for c in insp.get_columns(t)},
            "pk": (pk["name"], pk["constrained_columns"]),
            "fks": sorted((f["name"], tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]))
                          for f in insp.get_foreign_keys(t)),
            "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"])) for i in insp.get_indexes(t)),
        }
    return out


def schema_of(url) -> dict:
    engine = create_engine(url)
    with engine.connect() as conn:
        got = schema(conn)
    engine.dispose()
    return got


def rows(path: Path, table: str, columns: str = "*") -> list[dict]:
    with sqlite3.connect(path) as c:
        c.row_factory = sqlite3.Row
        return sorted((dict(r) for r in c.execute(f"select {columns} from {table}")), key=repr)  # noqa: S608 (fixed names)


def legacy_run(tmp_path: Path, which: str) -> Path:
    """A copy of the fixture as the store of an old run directory (named as the old code's run id)."""
    run_dir = tmp_path / LEGACY[which].stem
    run_dir.mkdir()
    shutil.copyfile(LEGACY[which], run_dir / "trajectories.db")
    return run_dir


def test_head_is_0008_and_the_baseline_is_d07e8ae_exactly(tmp_path):
    from alembic import command

    assert head_revision() == HEAD
    engine = create_engine(sqlite_url(tmp_path / "base.db"))
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0001")
    with engine.connect() as conn:
        baseline = schema(conn)
        assert schema_state(conn) == "0001"
    engine.dispose()
    assert baseline == schema_of(sqlite_url(LEGACY["d07e8ae"]))
    # and in d07e8ae's column order, as its create_all wrote them
    with sqlite3.connect(tmp_path / "base.db") as a, sqlite3.connect(LEGACY["d07e8ae"]) as b:
        for t in baseline:
            assert [r[1] for r in a.execute(f"pragma table_info({t})")] == [r[1] for r in b.execute(f"pragma table_info({t})")]


def test_a_migrated_store_equals_a_new_one(tmp_path):
    fresh = TrajectoryStore(sqlite_url(tmp_path / "fresh.db"), "r")
    fresh.close()
    expected = schema_of(sqlite_url(tmp_path / "fresh.db"))
    assert expected["samples"]["pk"] == ("pk_samples", ["run_id", "sample_id"])
    assert expected["segments"]["fks"] == [("fk_segments_samples", ("run_id", "sample_id"), "samples", ("run_id", "sample_id"))]
    from rl.store.schema import BROWSE_INDEXES  # the models declare revision 0008's indexes as it made them

    assert {(n, tuple(c)) for n, c in BROWSE_INDEXES.items()} <= {(n, c) for n, c, _ in expected["samples"]["indexes"]}
    for which in LEGACY:
        shutil.copyfile(LEGACY[which], tmp_path / f"{which}.db")
        assert upgrade_store(sqlite_url(tmp_path / f"{which}.db")) == (f"unversioned-{which}", HEAD)
        assert schema_of(sqlite_url(tmp_path / f"{which}.db")) == expected, which
        for db in (tmp_path / "fresh.db", tmp_path / f"{which}.db"):  # the inspector skips expression indexes
            with sqlite3.connect(db) as c:
                sql = c.execute("select sql from sqlite_master where name = 'ix_samples_browse_lag'").fetchone()
            assert sql and "(max_version - min_version)" in sql[0], (db, sql)


@pytest.mark.parametrize("which", sorted(LEGACY))
def test_rl_db_upgrade_keeps_every_row_and_the_new_code_reads_them(tmp_path, capsys, which):
    run_dir = legacy_run(tmp_path, which)
    db = run_dir / "trajectories.db"
    before = {t: rows(db, t) for t in OLD_TABLES}
    old_segments = rows(db, "segments", "sample_id, start, \"end\", policy_version")
    assert len(before["samples"]) == 32 and len(before["trained"]) == 32 and len(before["restarts"]) == 1

    assert main(["db", "upgrade", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out == f"{sqlite_url(db).render_as_string()}: unversioned-{which} -> {HEAD}\n"
    assert main(["db", "upgrade", str(db)]) == 0 and capsys.readouterr().out.endswith(f": already at {HEAD}\n")

    after = {t: rows(db, t) for t in OLD_TABLES}
    assert all(r.pop("reason") is None for r in after["samples"])  # revision 0003's column: unknown for old rows
    assert all(r.pop("failure") is None for r in after["samples"])  # revision 0005's: no tool calls, no failures
    if which == "pre-effort":  # the column is new to these rows: NULL, as for a run without effort control
        assert all(r.pop("effort") is None for r in after["samples"])
    else:
        assert {r["effort"] for r in after["samples"]} == {25, 100}
    assert after == before
    run_id = run_dir.name
    assert rows(db, "segments") == sorted(({"run_id": run_id, **s} for s in old_segments), key=repr)
    assert rows(db, "turns") == []  # revision 0004's table: old samples are single-turn

    store = TrajectoryStore.read_run(run_dir)  # no run.json: the old store's id, the directory name
    assert store.run_id == run_id
    for old in before["samples"]:
        x = store.get_sample(old["sample_id"])
        assert list(x.response_tokens) == decode_array(old["response_tokens"], "<i4").tolist()
        assert x.reward == old["reward"] and store.sample_train_step(x.sample_id) == old["train_step"] and x.turns == ()
        assert x.failure is None
        assert store.segments(x.sample_id) == [(s["start"], s["end"], s["policy_version"]) for s in
                                               sorted(old_segments, key=lambda s: s["start"]) if s["sample_id"] == x.sample_id]
    assert store.audit() == {"trained_twice": 0, "trained": 32, "link_mismatch": 0, "prompts": 12, "prompts_open": 0}
    assert len(store.restarts()) == 1 and store.train_step_metrics(before["train_steps"][0]["step"]) is not None
    store.close()
    assert main(["traj", "ls", str(run_dir), "--step", str(before["samples"][0]["train_step"])]) == 0
    assert "samples shown" in capsys.readouterr().out


def test_a_writer_upgrades_on_open_keeps_the_old_run_id_and_shares_the_file(tmp_path):
    run_dir = legacy_run(tmp_path, "pre-effort")
    (run_dir / "recipe.yaml").write_text("run: {name: legacy}\n")  # an old job ran here
    store = TrajectoryStore.for_run_dir(run_dir)
    assert store.run_id == run_dir.name and (run_dir / "run.json").is_file()
    assert store.audit()["trained"] == 32
    # A second run in the same file reuses the legacy run's ids without touching its rows.
    taken = rows(run_dir / "trajectories.db", "samples", "sample_id")[0]["sample_id"]
    other = TrajectoryStore(store.url, "other-run")
    other.add_samples([make_sample(taken, reward=-7.0)])
    other.mark_trained([taken], step=1)
    assert other.get_sample(taken).reward == -7.0 and store.get_sample(taken).reward != -7.0
    assert store.sample_train_step(taken) != 1 and store.audit()["link_mismatch"] == 0
    store.close(), other.close()


def _assert_one_line_error(rc, capsys, *needles):
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_readers_refuse_an_old_store_and_leave_it_untouched(tmp_path, capsys):
    run_dir = legacy_run(tmp_path, "d07e8ae")
    original = (run_dir / "trajectories.db").read_bytes()
    for cmd in (["ls", run_dir], ["show", run_dir, "s1-p0000000-0"]):
        _assert_one_line_error(main(["traj", *map(str, cmd)]), capsys, "rl db upgrade", str(run_dir), "unversioned-d07e8ae")
    with pytest.raises(StoreError, match="rl db upgrade"):
        TrajectoryStore.read_run(run_dir)
    assert (run_dir / "trajectories.db").read_bytes() == original
    assert sorted(p.name for p in run_dir.iterdir()) == ["trajectories.db"]  # no run.json, -wal, -shm or lock


@pytest.mark.parametrize("content", ["empty", "other"])
def test_readers_refuse_a_database_that_is_not_a_store_and_create_nothing(tmp_path, capsys, content):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "trajectories.db"
    db.touch()
    if content == "other":
        with sqlite3.connect(db) as c:
            c.execute("create table notes (x text)")
    original = db.read_bytes()
    _assert_one_line_error(main(["traj", "ls", str(run_dir)]), capsys, "not an asyncrl trajectory store")
    _assert_one_line_error(main(["db", "upgrade", str(run_dir)]), capsys, "holds no trajectory store")
    assert db.read_bytes() == original and sorted(p.name for p in run_dir.iterdir()) == ["trajectories.db"]


def test_a_store_newer_than_the_code_is_refused(tmp_path, capsys):
    url = sqlite_url(tmp_path / "new.db")
    TrajectoryStore(url, "r").close()
    with sqlite3.connect(tmp_path / "new.db") as c:
        c.execute("update alembic_version set version_num = '0099'")
    with pytest.raises(StoreError, match=f"newer than this code's {HEAD}"):
        TrajectoryStore(url, "r")
    with pytest.raises(StoreError, match=f"newer than this code's {HEAD}"):
        TrajectoryStore(url, "r", readonly=True)
    _assert_one_line_error(main(["db", "upgrade", str(tmp_path / "new.db")]), capsys, "update asyncrl")


def test_an_upgrade_that_fails_half_way_changes_nothing(tmp_path):
    shutil.copyfile(LEGACY["d07e8ae"], tmp_path / "s.db")
    with sqlite3.connect(tmp_path / "s.db") as c:  # makes revision 0002 fail after it re-keyed samples
        c.execute("create table segments_0002 (x integer)")
    original = rows(tmp_path / "s.db", "sqlite_master")  # every table, index and its DDL
    with pytest.raises(StoreError, match="segments_0002"):
        TrajectoryStore(sqlite_url(tmp_path / "s.db"), "store-d07e8ae")
    assert rows(tmp_path / "s.db", "sqlite_master") == original  # no alembic_version, samples keyed as before
    assert len(rows(tmp_path / "s.db", "samples")) == 32


def test_an_unrecognised_unversioned_layout_is_refused(tmp_path):
    with sqlite3.connect(tmp_path / "s.db") as c:
        c.execute("create table samples (sample_id text primary key, run_id text)")
    with pytest.raises(StoreError, match="cannot be upgraded"):
        upgrade_store(sqlite_url(tmp_path / "s.db"))
    with sqlite3.connect(tmp_path / "s.db") as c:
        assert [r[0] for r in c.execute("select name from sqlite_master where type = 'table'")] == ["samples"]


def test_an_upgrade_waits_for_the_migration_lock(tmp_path):
    shutil.copyfile(LEGACY["d07e8ae"], tmp_path / "s.db")
    url = sqlite_url(tmp_path / "s.db")
    with open(tmp_path / "s.db.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = []
        worker = threading.Thread(target=lambda: result.append(upgrade_store(url)))
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and result == []  # blocked behind the lock, nothing written
        engine = create_engine(url)
        with engine.connect() as conn:
            assert schema_state(conn) == "unversioned-d07e8ae"
        engine.dispose()
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(timeout=30)
    assert result == [("unversioned-d07e8ae", HEAD)]


def test_two_writers_creating_one_store_at_once(tmp_path):
    url = sqlite_url(tmp_path / "shared.db")
    barrier, errors = threading.Barrier(4), []

    def open_and_write(i: int) -> None:
        try:
            barrier.wait()
            s = TrajectoryStore(url, f"run-{i}")
            s.add_samples([make_sample("s1-p0000000-0", reward=float(i))])
            s.close()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=open_and_write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("select version_num from alembic_version")).scalars().all() == [HEAD]
        assert conn.execute(text("select run_id, reward from samples order by run_id")).all() == [
            (f"run-{i}", float(i)) for i in range(4)]
    engine.dispose()

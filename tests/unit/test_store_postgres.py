"""The store on a real PostgreSQL server (tests/postgres.py; skipped locally without one, a failure
under CI=true) and, where the rule is the store's rather than the backend's, on SQLite side by side:
runs that share a database and reuse ids, migrations of unversioned stores, the migration lock,
read-only readers."""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import replace

import pytest
from sqlalchemy import MetaData, create_engine, insert, select, text
from sqlalchemy.exc import SQLAlchemyError

from rl.cli import main
from rl.store.trajectories import StoreError, TrajectoryStore, Watermark
from rl.store.db import alembic_config, sqlite_url, upgrade_store
from rl.types import Prompt
from tests.unit.test_store import make_sample
from tests.unit.test_store_migrations import LEGACY, OLD_TABLES, schema_of

TABLES = ("runs", "prompts", "samples", "segments", "turns", "train_steps", "trained", "config_versions", "restarts",
          "checkpoints")


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request, tmp_path):
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "shared.db")
    return request.getfixturevalue("postgres_url")


def rows_of(url, run_id: str) -> dict[str, list[tuple]]:
    """Every row of one run, every column, in a stable order."""
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=TABLES)
    with engine.connect() as conn:
        out = {t: sorted(conn.execute(select(meta.tables[t]).where(meta.tables[t].c.run_id == run_id)).all(), key=repr)
               for t in TABLES}
    engine.dispose()
    return out


def test_two_runs_reusing_ids_never_touch_each_others_rows(shared_url):
    a, b = TrajectoryStore(shared_url, "run-a"), TrajectoryStore(shared_url, "run-b")
    ids = ["s1-p0000000-0", "s1-p0000000-1"]
    for store, reward in ((a, 1.0), (b, -1.0)):
        store.add_run(store.run_id, "{}")
        store.add_prompts([Prompt("p0", "arith", "1+1=", (1, 20, 21), "2", group_size=2, policy_version=0)])
        store.add_samples([make_sample(i, reward=reward, versions=(0, 0, 1)) for i in ids])
        store.add_config_version(1, "applied", {"mixture": {"arith": 1}}, train_step=0)
    b_before = rows_of(shared_url, "run-b")
    assert sum(len(v) for v in b_before.values()) == 1 + 1 + 2 + 4 + 1

    # Every write of run a, including one that names ids run b also has ...
    a.set_teacher([ids[0]], "t-a")
    a.mark_trained(ids, step=1)
    a.add_train_step(1, {"rl/loss": 0.5})
    a.set_outcome(["p0"], "trained")
    assert rows_of(shared_url, "run-b") == b_before  # ... leaves run b's rows as they were
    assert (a.get_sample(ids[0]).teacher, b.get_sample(ids[0]).teacher) == ("t-a", None)
    assert (a.get_sample(ids[0]).reward, b.get_sample(ids[0]).reward) == (1.0, -1.0)
    assert (a.sample_train_step(ids[0]), b.sample_train_step(ids[0])) == (1, None)
    assert a.segments(ids[0]) == b.segments(ids[0]) == [(0, 2, 0), (2, 3, 1)]
    assert a.audit()["trained"] == 2 and b.audit()["trained"] == 0

    b.mark_trained([ids[1]], step=1)  # run b trains its own sample of the same id once
    b_after = rows_of(shared_url, "run-b")
    assert a.rollback_to(Watermark(0, 0), checkpoint="") == {
        "samples_regenerated": 2, "prompts_redispatched": 1, "samples_untrained": 0, "train_steps_rolled_back": 1}
    assert a.count_samples() == 0 and a.segments(ids[0]) == [] and a.train_step_metrics(1) is None
    assert a.config_versions() == [] and a.audit()["prompts"] == 0
    assert rows_of(shared_url, "run-b") == b_after and b.audit() == {
        "trained_twice": 0, "trained": 1, "link_mismatch": 0, "prompts": 1, "prompts_open": 1}
    assert a.run_ids() == ["run-a", "run-b"]
    a.close(), b.close()


def _comparable(url, run_id: str) -> dict[str, list[tuple]]:
    """A run's rows less what differs between two runs writing the same things: run id, times, row ids."""
    drop = {"run_id", "dispatched_at", "created_at", "id"}
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=("prompts", "samples", "segments"))
    with engine.connect() as conn:
        out = {name: sorted(tuple(v for k, v in row._mapping.items() if k not in drop)
                            for row in conn.execute(select(t).where(t.c.run_id == run_id)))
               for name, t in meta.tables.items()}
    engine.dispose()
    return out


def _call_writes(store):
    """One rollout call's writes: prompts, samples, outcomes."""
    store.add_prompts([Prompt("p0", "arith", "1+1=", (1, 20, 21), "2", group_size=2, policy_version=0)])
    store.add_samples([make_sample("p0-0", versions=(0, 0, 1)), make_sample("p0-1", reward=0.0, versions=(1, 1))])
    store.add_prompts([Prompt(f"p{i}", "arith", "2+2=", (1, 22), "4", group_size=2, policy_version=1) for i in (1, 2)])
    store.set_outcome(["p0", "p1"], "filtered")
    store.add_samples([make_sample("p2-0", prompt_id="p2", group_id="p2", versions=(1,))])


def test_a_batch_writes_what_the_calls_write_one_at_a_time_in_one_commit(shared_url):
    """TrajectoryStore.batch(): the controller's prompts, samples and outcomes of one rollout call in one
    transaction: the same rows (sequence numbers included) as one call at a time; nothing visible before the block
    ends; a write the batch does not take is refused inside it and what came before is kept."""
    writes = _call_writes
    one, batched = TrajectoryStore(shared_url, "run-one"), TrajectoryStore(shared_url, "run-batched")
    writes(one)
    reader = TrajectoryStore(shared_url, "run-batched", readonly=True)
    with batched.batch():
        writes(batched)
        assert reader.count_samples() == 0 and reader.audit()["prompts"] == 0  # not committed yet
        assert batched.last_commit_s == 0.0
    assert batched.last_commit_s > 0 and reader.count_samples() == 3
    assert _comparable(shared_url, "run-batched") == _comparable(shared_url, "run-one")
    assert sum(map(len, _comparable(shared_url, "run-one").values())) == 3 + 3 + 4

    with pytest.raises(RuntimeError, match="inside batch"):  # would wait on the batch's own lock (SQLite)
        with batched.batch():
            batched.add_prompts([Prompt("p3", "arith", "3+3=", (1, 23), "6", group_size=2, policy_version=2)])
            batched.mark_trained(["p0-0"], step=1)
    assert reader.audit()["prompts"] == 4 and batched.sample_train_step("p0-0") is None  # p3 kept, nothing trained
    with pytest.raises(RuntimeError, match="already open"):
        with batched.batch(), batched.batch():
            pass
    batched.mark_trained(["p0-0"], step=1)  # writes of their own work again after the block
    assert batched.sample_train_step("p0-0") == 1
    for s in (one, batched, reader):
        s.close()


def test_a_background_batch_runs_on_the_stores_thread_and_reads_wait_for_it(shared_url):
    """batch(background=True), as the controller writes a rollout call: the block only builds the rows and returns
    before they are written; the store's thread writes the same rows as one call at a time, in one transaction; the
    store's own reads and other writes wait for it; a batch that fails keeps nothing, its error is raised once (at the
    next read or batch) and the store goes on; a checkpoint's watermark comes after every queued batch committed."""
    one, bg = TrajectoryStore(shared_url, "run-one"), TrajectoryStore(shared_url, "run-bg")
    _call_writes(one)
    reader = TrajectoryStore(shared_url, "run-bg", readonly=True)
    gate, ran_on = threading.Event(), []
    run = bg._run

    def held(ops):  # the writer thread waits for the gate: the block must not
        ran_on.append(threading.get_ident())
        assert gate.wait(10)
        run(ops)
    bg._run = held
    with bg.batch(background=True):
        _call_writes(bg)
    assert reader.count_samples() == 0 and reader.audit()["prompts"] == 0 and bg.last_commit_s == 0.0  # not yet
    gate.set()
    assert bg.count_samples() == 3  # its own read waited for the writer
    assert ran_on and ran_on[0] != threading.get_ident() and bg.writer_s > 0 and reader.count_samples() == 3
    assert _comparable(shared_url, "run-bg") == _comparable(shared_url, "run-one")

    with bg.batch(background=True):  # a duplicate sample id: the transaction fails on the writer thread
        bg.add_prompts([Prompt("p9", "arith", "9+9=", (1, 29), "18", group_size=2, policy_version=2)])
        bg.add_samples([make_sample("p0-0")])
    with pytest.raises(SQLAlchemyError):
        bg.audit()
    assert bg.audit()["prompts"] == 3 and bg.count_samples() == 3  # nothing of it kept; said once, then on
    with pytest.raises(ValueError, match="per-token arrays"):  # the block raises: what it wrote before is kept
        with bg.batch(background=True):
            bg.add_prompts([Prompt("p4", "arith", "4+4=", (1, 24), "8", group_size=2, policy_version=2)])
            bg.add_samples([replace(make_sample("p4-0", prompt_id="p4", group_id="p4"), policy_versions_T=(1,))])
    bg.mark_trained(["p0-0"], step=1)  # a write of its own, after the queued batch
    assert bg.audit()["prompts"] == 4 and bg.sample_train_step("p0-0") == 1
    gate.clear()
    with bg.batch(background=True):
        bg.add_prompts([Prompt("p5", "arith", "5+5=", (1, 25), "10", group_size=2, policy_version=2)])
    threading.Timer(0.3, gate.set).start()
    bg.watermark(1)  # a checkpoint's watermark: every row numbered so far is committed first
    assert reader.audit()["prompts"] == 5
    for s in (one, bg, reader):
        s.close()


def _legacy_rows(which: str) -> dict[str, list[dict]]:
    with sqlite3.connect(LEGACY[which]) as c:
        c.row_factory = sqlite3.Row
        return {t: [dict(r) for r in c.execute(f"select * from {t}")] for t in (*OLD_TABLES, "segments")}  # noqa: S608


@pytest.mark.parametrize("which", sorted(LEGACY))
def test_an_unversioned_postgres_store_upgrades_with_every_row(postgres_server, capsys, which):
    from alembic import command

    url = postgres_server.create_database()
    engine = create_engine(url)
    data = _legacy_rows(which)
    with engine.begin() as conn:  # what the old code's create_all made, with an old run's rows
        command.upgrade(alembic_config(conn), "0001")
        conn.execute(text("DROP TABLE alembic_version"))
        if which == "pre-effort":
            conn.execute(text("ALTER TABLE samples DROP COLUMN effort"))
        meta = MetaData()
        meta.reflect(conn)
        for t, rows in data.items():
            for r in rows if t == "samples" else []:
                r["correct"] = bool(r["correct"])  # SQLite's 0/1
            if rows:
                conn.execute(insert(meta.tables[t]), rows)
    engine.dispose()

    assert main(["db", "upgrade", url.render_as_string(hide_password=False)]) == 0
    assert capsys.readouterr().out == f"{url.render_as_string()}: unversioned-{which} -> 0008\n"
    fresh = postgres_server.create_database()
    upgrade_store(fresh)
    assert schema_of(url) == schema_of(fresh)
    store = TrajectoryStore(url, f"store-{which}", readonly=True)
    got = rows_of(url, store.run_id)
    for t in OLD_TABLES:
        columns = [c for c in data[t][0]] if data[t] else []
        assert sorted((tuple(r._mapping[c] for c in columns) for r in got[t]), key=repr) == sorted(
            (tuple(bool(v) if c == "correct" else v for c, v in r.items()) for r in data[t]), key=repr), t
    assert sorted((r.sample_id, r.start, r.end, r.policy_version) for r in got["segments"]) == sorted(
        (r["sample_id"], r["start"], r["end"], r["policy_version"]) for r in data["segments"])
    assert store.audit() == {"trained_twice": 0, "trained": 32, "link_mismatch": 0, "prompts": 12, "prompts_open": 0}
    store.close()


def test_concurrent_jobs_create_one_postgres_store(postgres_url):
    barrier, results, errors = threading.Barrier(4), [], []

    def upgrade() -> None:
        try:
            barrier.wait()
            results.append(upgrade_store(postgres_url))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=upgrade) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(results) == [("0008", "0008")] * 3 + [("empty", "0008")]


def test_postgres_readers_cannot_write_and_refuse_an_older_store(postgres_url):
    writer = TrajectoryStore(postgres_url, "r")
    writer.add_train_step(1, {"rl/loss": 1.0})
    writer.close()
    reader = TrajectoryStore(postgres_url, "r", readonly=True)
    assert reader.train_step_metrics(1) == {"rl/loss": 1.0}
    with pytest.raises(SQLAlchemyError, match="read-only"):
        reader.add_train_step(2, {})
    reader.close()
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0001'"))
    engine.dispose()
    with pytest.raises(StoreError, match="schema 0001, older than this code's 0008; upgrade it with: rl db upgrade"):
        TrajectoryStore(postgres_url, "r", readonly=True)

"""TrajectoryStore on a real SQLite file in tmp_path."""

from __future__ import annotations

import json
import sqlite3
import uuid

import numpy as np
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from rl.store.trajectories import (
    PromptTable,
    SampleTable,
    SegmentTable,
    TrajectoryStore,
    decode_array,
    encode_array,
    segments_from_versions,
)
from rl.types import Prompt, Sample


def make_sample(sample_id: str = "s0", *, dataset: str = "arith", reward: float = 1.0, versions=(3, 3, 4, 4, 4, 6),
                status: str = "finished", finished_at: float = 100.0, routing: bool = False, **kw) -> Sample:
    n = len(versions)
    trace = None
    if routing:  # [prompt_len + response_len - 1, layers, top_k], values beyond int8 and negative
        trace = (np.arange((3 + n - 1) * 2 * 4, dtype=np.int16).reshape(3 + n - 1, 2, 4) * 97 - 300)
    fields = dict(
        sample_id=sample_id, prompt_id="p0", dataset=dataset, group_id="p0",
        prompt_tokens=(1, 40, 41), response_tokens=tuple(50 + i for i in range(n)),
        prompt_text="Q?", response_text="A" * n,
        behavior_logprobs_T=tuple(-0.1 * (i + 1) / 3 for i in range(n)), policy_versions_T=tuple(versions),
        reward=reward, correct=reward > 0, finish_reason="eos", status=status,
        timings={"dispatched_at": finished_at - 2.5, "finished_at": finished_at, "generate_s": 1.25},
        routing_trace=trace,
    )
    fields.update(kw)
    return Sample(**fields)


@pytest.fixture
def store(tmp_path):
    s = TrajectoryStore.for_run_dir(tmp_path / "run")
    yield s
    s.close()


def test_sample_round_trip_keeps_every_field(store):
    x = make_sample(routing=True, response_text="line one\nline two!", finish_reason="length", reward=-0.25,
                    effort=75, teacher="t07", config_version=2)
    store.add_samples([x])
    y = store.get_sample("s0")
    assert y is not None
    for name in ("sample_id", "prompt_id", "dataset", "group_id", "prompt_tokens", "response_tokens", "prompt_text",
                 "response_text", "policy_versions_T", "reward", "correct", "finish_reason", "status", "timings",
                 "effort", "teacher", "config_version"):
        assert getattr(y, name) == getattr(x, name), name
    assert all(isinstance(t, int) for t in y.response_tokens)
    # Stored as float32: equal to float32 precision, not exactly (-0.1/3 is not a float32).
    np.testing.assert_allclose(y.behavior_logprobs_T, x.behavior_logprobs_T, rtol=1e-6)
    assert y.behavior_logprobs_T == tuple(np.float32(v).item() for v in x.behavior_logprobs_T)
    assert y.routing_trace.dtype == np.int16 and y.routing_trace.shape == x.routing_trace.shape
    np.testing.assert_array_equal(y.routing_trace, x.routing_trace)
    assert y.num_response_tokens == 6


def test_round_trip_without_routing_or_timings(store):
    store.add_samples([make_sample(timings={})])
    y = store.get_sample("s0")
    assert y.routing_trace is None and y.timings == {}
    assert store.get_sample("missing") is None


def test_arrays_are_little_endian_bytes():
    assert encode_array([1, 258], "<i4") == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    assert encode_array([-2], "<i2") == b"\xfe\xff"
    back = decode_array(encode_array([[1, -2], [3, 4]], "<i2"), "<i2", (2, 2))
    assert back.dtype == np.int16 and back.tolist() == [[1, -2], [3, 4]]
    back[0, 0] = 7  # writable copy, not a view of the blob


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ([3, 3, 4, 4, 4, 6], [(0, 2, 3), (2, 5, 4), (5, 6, 6)]),
        ([5], [(0, 1, 5)]),
        ([2, 2, 2], [(0, 3, 2)]),
        ([1, 2, 1], [(0, 1, 1), (1, 2, 2), (2, 3, 1)]),
        ([], []),
    ],
)
def test_segments_from_versions(versions, expected):
    assert segments_from_versions(versions) == expected


def test_segments_written_at_insert(store):
    store.add_samples([make_sample("a", versions=(3, 3, 4, 4, 4, 6)), make_sample("b", versions=(7, 7))])
    assert store.segments("a") == [(0, 2, 3), (2, 5, 4), (5, 6, 6)]
    assert store.segments("b") == [(0, 2, 7)]
    assert store.segments("nope") == []


def test_version_range_columns(store):
    store.add_samples([make_sample("a", versions=(5, 3, 9, 4)), make_sample("e", versions=())])
    rows = {r.sample_id: r for r in store.query()}
    assert (rows["a"].min_version, rows["a"].max_version, rows["a"].num_response_tokens) == (3, 9, 4)
    assert (rows["e"].min_version, rows["e"].max_version, rows["e"].num_response_tokens) == (None, None, 0)


def test_query_filters(store):
    store.add_samples([
        make_sample("a1", dataset="arith", reward=1.0, finished_at=1),
        make_sample("a2", dataset="arith", reward=0.0, finished_at=2),
        make_sample("a3", dataset="arith", reward=0.5, finished_at=3, status="discarded"),
        make_sample("g1", dataset="gsm", reward=1.0, finished_at=4, effort=25, teacher="t1"),
        make_sample("g2", dataset="gsm", reward=-1.0, finished_at=5, effort=100, teacher="t1"),
    ])
    store.mark_trained(["a2", "g1"], step=7)
    store.mark_trained(["a1"], step=8)

    def ids(**kw):
        return [r.sample_id for r in store.query(**kw)]

    assert ids() == ["a1", "a2", "a3", "g1", "g2"]  # oldest first
    assert ids(dataset="gsm") == ["g1", "g2"]
    assert ids(min_reward=0.5) == ["a1", "a3", "g1"]  # bounds inclusive
    assert ids(max_reward=0.0) == ["a2", "g2"]
    assert ids(min_reward=0.0, max_reward=0.5) == ["a2", "a3"]
    assert ids(dataset="arith", min_reward=1) == ["a1"]
    assert ids(train_step=7) == ["a2", "g1"]
    assert ids(train_step=9) == []
    assert ids(status="discarded") == ["a3"]
    assert ids(effort=25) == ["g1"] and ids(teacher="t1") == ["g1", "g2"] and ids(teacher="t2") == []
    assert ids(limit=2) == ["a1", "a2"]
    row = store.query(train_step=8)[0]
    assert (row.train_step, row.correct, row.reward, row.status) == (8, True, 1.0, "finished")
    assert store.sample_train_step("a2") == 7 and store.sample_train_step("a3") is None
    assert store.count_samples() == 5


def test_query_preview_is_a_prefix(store):
    long = "x\n" * 500
    store.add_samples([make_sample(response_text=long)])
    preview = store.query()[0].response_preview
    assert long.startswith(preview) and 40 <= len(preview) < len(long)


def test_mark_trained_rejects_unknown_ids_atomically(store):
    store.add_samples([make_sample("a")])
    with pytest.raises(ValueError, match="1 of 2"):
        store.mark_trained(["a", "ghost"], step=1)
    assert store.sample_train_step("a") is None


def test_marking_no_samples_trained_is_a_no_op(store):
    """An empty train step (every group filtered) stamps nothing; it used to insert a NULL row and raise."""
    store.add_samples([make_sample("a")])
    store.mark_trained([], step=3)
    assert store.sample_train_step("a") is None


def test_a_sample_is_trained_at_most_once(store):
    store.add_samples([make_sample("a"), make_sample("b")])
    store.mark_trained(["a"], step=1)
    with pytest.raises(ValueError, match="already trained"):
        store.mark_trained(["b", "a"], step=2)
    assert store.sample_train_step("a") == 1 and store.sample_train_step("b") is None  # nothing marked
    with pytest.raises(ValueError, match="appears twice"):
        store.mark_trained(["b", "b"], step=2)


def test_add_samples_is_one_transaction(store):
    with pytest.raises(IntegrityError):
        store.add_samples([make_sample("a"), make_sample("a")])
    assert store.count_samples() == 0
    with store._sessions() as s:
        assert s.scalars(select(SegmentTable)).all() == []


def test_add_samples_rejects_ragged_per_token_arrays(store):
    with pytest.raises(ValueError, match="s0"):
        store.add_samples([make_sample(behavior_logprobs_T=(-1.0,))])


def test_runs_are_isolated_in_one_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    a, b = TrajectoryStore(url, "run-a"), TrajectoryStore(url, "run-b")
    a.add_samples([make_sample("x")])
    b.add_samples([make_sample("y"), make_sample("z")])
    assert [r.sample_id for r in a.query()] == ["x"]
    assert (a.count_samples(), b.count_samples()) == (1, 2)
    assert a.run_ids() == ["run-a", "run-b"]
    a.close(), b.close()


def test_sqlite_uses_wal(store, tmp_path):
    with store._engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL
    # WAL is a property of the file: a plain sqlite3 connection sees it too.
    raw = sqlite3.connect(tmp_path / "run" / "trajectories.db")
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()


def test_for_run_dir_defaults(tmp_path):
    s = TrajectoryStore.for_run_dir(f"{tmp_path}/exp-1/")
    # The run's identity is a UUID kept in run.json, not the directory's name (rl/store/identity.py).
    assert str(uuid.UUID(s.run_id)) == s.run_id
    assert json.loads((tmp_path / "exp-1" / "run.json").read_text())["run_id"] == s.run_id
    assert s.url.get_backend_name() == "sqlite" and s.url.database == str(tmp_path / "exp-1" / "trajectories.db")
    assert (tmp_path / "exp-1" / "trajectories.db").is_file()
    s.close()
    s = TrajectoryStore.for_run_dir(tmp_path / "d", url=f"sqlite:///{tmp_path / 'other.db'}", run_id="r")
    assert s.run_id == "r" and (tmp_path / "other.db").is_file()
    s.close()


def test_add_run_is_idempotent(store):
    store.add_run("first", '{"lr": 1e-5}')
    store.add_run("second", '{"lr": 2e-5}')
    with store._engine.connect() as conn:
        rows = conn.execute(text("SELECT run_id, name, recipe_json FROM runs")).all()
    assert rows == [(store.run_id, "first", '{"lr": 1e-5}')]


def test_train_step_metrics_round_trip(store):
    metrics = {"rl/loss": 0.125, "stale/masked_frac": np.float32(0.5), "batch/size": 64}
    store.add_train_step(3, metrics)
    store.add_train_step(4, {"rl/loss": 0.25})
    assert store.train_step_metrics(3) == {"rl/loss": 0.125, "stale/masked_frac": 0.5, "batch/size": 64}
    assert store.train_step_metrics(5) is None
    store.add_train_step(4, {"rl/loss": 0.5})  # replayed after resume: last write wins, no duplicate
    assert store.train_step_metrics(4) == {"rl/loss": 0.5}
    with store._engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM train_steps")).scalar() == 2


def test_add_prompts(store):
    store.add_prompts([Prompt("p0", "arith", "1+1=", (1, 20, 21), "2", group_size=8, policy_version=np.int64(4))])
    with store._sessions() as s:
        row = s.scalars(select(PromptTable)).one()
    assert (row.run_id, row.dataset, row.text, row.answer, row.group_size, row.policy_version) == (
        store.run_id, "arith", "1+1=", "2", 8, 4)
    assert decode_array(row.tokens, "<i4").tolist() == [1, 20, 21] and row.dispatched_at > 0
    with store._sessions() as s:
        assert s.scalars(select(SampleTable)).all() == []


def test_recorded_train_steps_reads_a_live_store_and_is_zero_before_it_exists(tmp_path):
    from rl.store.trajectories import recorded_train_steps

    assert recorded_train_steps(tmp_path / "not-yet") == 0
    store = TrajectoryStore.for_run_dir(tmp_path / "run")
    store.add_train_step(1, {"rl/loss": 0.5})
    store.add_train_step(2, {"rl/loss": 0.25})
    assert recorded_train_steps(tmp_path / "run") == 2
    store.close()

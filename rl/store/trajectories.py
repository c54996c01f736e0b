"""Trajectory store: every prompt, sample and train step of a run, in SQL (SQLAlchemy 2.x).

The tables (rl/store/schema.py) are a storage mapping kept apart from the domain records in
`rl.types` (which stay frozen dataclasses); `TrajectoryStore` converts between the two. One writer
per run, the controller; readers (`rl traj ...`) may open the store while it runs (SQLite in WAL mode).

Many runs, one database: the default store is `RUN_DIR/trajectories.db` (SQLite), and `store.url`
may name any SQLAlchemy database (e.g. `postgresql+psycopg://user@host/asyncrl`) that many runs
share. A run's identity is the UUID in `RUN_DIR/run.json` (rl/store/identity.py), not its directory's name;
every row carries it, the ids a run chooses are unique only within the run (keys (run_id, prompt_id),
(run_id, sample_id); segments and `trained` rows reference (run_id, sample_id)), and every read,
update and delete here filters on the store's `run_id`, so one run never sees or changes another's rows.

Schema versions (rl/store/db.py): the writer upgrades the database to this code's revision when it
opens it, under a lock; readers open read-only and refuse an older store with one line naming
`rl db upgrade`.

Tables:
- `runs`        one row per run: name, creation time, the recipe as JSON.
- `prompts`     one row per dispatched prompt: dataset, text, answer, group size, policy version and
                time at dispatch.
- `samples`     one row per trajectory: ids, status, reward, texts, the token arrays, version range,
                timings, effort, teacher, config version and `train_step` (the optimizer step that
                consumed it; NULL until trained).
- `turns`       one row per turn of a multi-turn sample (tool calls): kind (model | tool), [start, end)
                in response-token indices, the turn's text (a tool turn's: its output as the model saw
                it), and for tool turns the tool, the call, status, exit code, truncation and wall seconds.
                Single-turn samples have none (revision 0004). A sample a tool call's sandbox failure
                ended keeps the reason in `samples.failure` (revision 0005; rl/algo/repercussion.py).
- `segments`    one row per maximal run of equal policy versions over a sample's response tokens,
                [start, end) in response-token indices; derived from `policy_versions_T` at insert,
                so "which samples span versions 3..5" is a SQL query rather than a blob scan.
- `train_steps` one row per (run, step) with the step's metrics as JSON.
- `trained`     one row per (sample, train step that consumed it): an audit of `samples.train_step`
                kept as a separate record; a sample trained twice would show as two rows.
- `config_versions` one row per live reconfiguration (applied or refused): the patch, the reason,
                the train step it took effect at (rl/reconfigure.py).
- `restarts`    one row per resume: the checkpoint it restarted from and what the rollback removed.
- `checkpoints` one row per committed checkpoint: its lineage token (also in RUN_DIR/run.json), name, train
                step and watermark `seq`; a resume from a copy of the run directory that fell behind is refused
                by it (rl/store/identity.py, rl/algo/resume.py), or forks the run (`fork`, `rl resume --new-identity`).

Resume (rl/checkpoint/format.py): every prompt, sample and outcome write takes the next number of one
run-wide `seq` counter; a checkpoint records a *watermark* (the last `seq` and the train step). On
resume, rows written after the watermark belong to work the restored job redoes with the same ids
(prompts re-dispatched, samples regenerated, train steps re-run), so `rollback_to` deletes them (of
this run only) and resets `train_step` on samples consumed by a rolled-back step (they are in the
checkpoint's untrained buffer and train again once); the `restarts` row counts each kind, so
nothing disappears unrecorded. Config versions applied after the watermark are applied again by the
restored controller (their rows go); a patch refused after it is not retried (its row stays). Each prompt's `outcome` says how its group ended: trained, discarded
(warm-up), dropped_stale (past max_version_lag), filtered (no reward spread: GRPOStage.dynamic_sampling),
dropped_stage_end.

Token arrays (token ids, behaviour logprobs, per-token policy versions, MoE routing traces) are
blobs of raw little-endian numpy bytes: a sample has hundreds to thousands of values per array that
are always read whole, never filtered on, so a row per token would multiply the table by the
sequence length for nothing, and the bytes decode with one `np.frombuffer`. Logprobs are stored as
float32 (the precision the engine produces); routing traces as int16 with their shape as "T,L,K".
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from itertools import groupby
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from sqlalchemy import Engine, delete, func, insert, literal, select, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rl.store.identity import own_store_url, read_run_file, read_run_identity, run_identity, run_store_url
from rl.store.db import (DB_FILE, StoreError, check_readable, parse_url, reader_engine, redacted, sqlite_file,
                         upgrade_store, writer_engine)
from rl.store.schema import (CheckpointTable, ConfigVersionTable, PromptTable, RestartTable, RunTable, SampleTable,
                             SegmentTable, TrainedTable, TrainStepTable, TurnTable)
from rl.types import Prompt, Sample, Turn

T = TypeVar("T")

__all__ = ["DB_FILE", "CheckpointTable", "ConfigVersionTable", "PromptTable", "RestartTable", "RunTable", "SampleRow", "SampleTable",
           "SegmentTable", "StoreError", "TrainStepTable", "TrainedTable", "TrajectoryStore", "TurnTable", "Watermark",
           "decode_array", "encode_array", "recorded_train_steps", "segments_from_versions"]

TOKEN_DTYPE = "<i4"
LOGPROB_DTYPE = "<f4"
VERSION_DTYPE = "<i4"
ROUTING_DTYPE = "<i2"
PREVIEW_CHARS = 120
"""How much of the response `query` returns (the rest stays in the database)."""
_TIMING_KEYS = ("dispatched_at", "finished_at", "generate_s")


def encode_array(values: Sequence | np.ndarray, dtype: str) -> bytes:
    """Raw little-endian bytes of `values` as `dtype` (e.g. "<i4"); the shape is not kept."""
    return np.ascontiguousarray(values, dtype=np.dtype(dtype)).tobytes()


def decode_array(blob: bytes, dtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of `encode_array`: a writable native-endian array, reshaped when `shape` is given."""
    arr = np.frombuffer(blob, dtype=np.dtype(dtype)).astype(np.dtype(dtype).newbyteorder("="))
    return arr if shape is None else arr.reshape(shape)


def segments_from_versions(policy_versions_T: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal versions as (start, end, policy_version), end exclusive.

    [3, 3, 4, 4, 4, 6] -> [(0, 2, 3), (2, 5, 4), (5, 6, 6)].
    """
    segments: list[tuple[int, int, int]] = []
    start = 0
    for version, run in groupby(policy_versions_T):
        end = start + sum(1 for _ in run)
        segments.append((start, end, int(version)))
        start = end
    return segments


_step_counters: dict[str, Engine] = {}
"""Reader engines of `recorded_train_steps` for server databases, kept across its polls."""


def recorded_train_steps(run_dir: str | Path, url: str | URL | None = None) -> int:
    """Train steps a (possibly live) run has recorded so far, read-only so that a watcher never
    contends with the job's writer; 0 while the store (or the run's run.json) does not exist yet.
    The store is `url`, else the run's own (rl/store/identity.py `run_store_url`)."""
    run_dir = Path(run_dir)
    try:
        run_id = read_run_file(run_dir)
        url, own = (parse_url(url), False) if url is not None else run_store_url(run_dir)
    except StoreError:
        return 0
    steps = TrainStepTable.__table__
    count = select(func.count()).select_from(steps)
    if run_id is not None:
        count = count.where(steps.c.run_id == run_id)
    elif not own:  # a shared database without this run's identity: nothing to count yet
        return 0
    path = sqlite_file(url)
    try:
        if path is not None:  # a fresh read-only connection per poll: no engine to keep per file
            engine = reader_engine(url)
            try:
                with engine.connect() as conn:
                    return conn.scalar(count)
            finally:
                engine.dispose()
        key = url.render_as_string(hide_password=False)
        if key not in _step_counters:
            _step_counters[key] = reader_engine(url)
        with _step_counters[key].connect() as conn:
            return conn.scalar(count)
    except (StoreError, SQLAlchemyError, sqlite3.Error):
        return 0


@dataclass(frozen=True)
class Watermark:
    """How far the store was written when a checkpoint was taken."""

    seq: int
    train_step: int


@dataclass(frozen=True)
class SampleRow:
    """One line of `TrajectoryStore.query`: the columns worth listing, without the token blobs."""

    sample_id: str
    prompt_id: str
    dataset: str
    reward: float
    correct: bool
    num_response_tokens: int
    min_version: int | None
    max_version: int | None
    train_step: int | None
    status: str
    response_preview: str
    """The first `PREVIEW_CHARS` characters of the response."""


def _raise_first(futures: list[Future]) -> None:
    """Wait for every future, then raise the first one's error (if any failed)."""
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise errors[0]


class _Recorded:
    """The connection a background `batch()` hands its writes: statements are recorded, to run on the store's writer
    thread in one transaction."""

    def __init__(self):
        self.ops: list[tuple] = []

    def execute(self, statement, parameters=None) -> None:
        self.ops.append((statement, parameters))


class TrajectoryStore:
    """Writes and reads one run's trajectories. Not shared across threads (one writer per run; a background
    `batch()` runs its statements on the store's own writer thread, in order).

    `TrajectoryStore(url, run_id)` and `for_run_dir` open for writing (upgrading the database
    first); `read_run` and `readonly=True` open for reading only (see rl/store/db.py)."""

    def __init__(self, url: str | URL, run_id: str, *, readonly: bool = False, name: str | None = None):
        """`name`: how a reader's errors name the store, e.g. its run directory (default: the URL)."""
        self.url = parse_url(url)
        self.run_id = run_id
        self.readonly = readonly
        if readonly:
            self._engine = reader_engine(self.url)
            try:
                check_readable(self._engine, redacted(self.url) if name is None else name)
            except StoreError:
                self._engine.dispose()
                raise
        else:
            upgrade_store(self.url)
            self._engine = writer_engine(self.url)
        self._writer: ThreadPoolExecutor | None = None  # background batches, run in order (`batch(background=True)`)
        self._pending: list[Future] = []
        self.writer_s = 0.0
        """Seconds the writer thread spent running background batches (their statements and commits)."""
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._seq = 0 if readonly else self._last_seq()
        self._batch = None  # the connection of an open `batch()` (or its _Recorded): its writes join that transaction
        self.last_commit_s = 0.0
        """Seconds the last `batch()` took to commit (0 for a background one: the writer thread commits)."""

    def _session(self):
        """A session for a read (after the background batches, so that it sees their writes)."""
        self.drain()
        return self._sessions()

    def drain(self) -> None:
        """Wait until every background batch is committed; a failed one's error is raised here (its transaction
        was rolled back: none of its writes are kept), once."""
        pending, self._pending = self._pending, []
        _raise_first(pending)

    def _last_seq(self) -> int:
        P, S, C = PromptTable, SampleTable, ConfigVersionTable
        with self._session() as s:
            return max(s.scalar(select(func.coalesce(func.max(col), 0)).where(table.run_id == self.run_id))
                       for col, table in ((P.seq, P), (P.outcome_seq, P), (S.seq, S), (C.seq, C)))

    @classmethod
    def for_run_dir(cls, run_dir: str | Path, url: str | URL | None = None, run_id: str | None = None,
                    name: str | None = None) -> TrajectoryStore:
        """The writing job's store of a run directory: `RUN_DIR/trajectories.db` unless `url` is given;
        `run_id` defaults to the run's identity (rl/store/identity.py `run_identity`, which creates run.json
        with `name` the first time)."""
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        store = own_store_url(run_dir) if url is None else parse_url(url)
        if run_id is None:
            run_id = run_identity(run_dir, name=name, store=None if url is None else store)
        return cls(store, run_id)

    @classmethod
    def read_run(cls, run_dir: str | Path, url: str | URL | None = None) -> TrajectoryStore:
        """A run's store opened read-only (nothing is created, migrated or written): its recipe's
        `store.url` or `RUN_DIR/trajectories.db` unless `url` is given. Raises `StoreError` (one
        line) for a missing directory or store, a file that is not a store, or an old schema."""
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise StoreError(f"run directory not found: {run_dir}")
        store, own = run_store_url(run_dir) if url is None else (parse_url(url), False)
        path = sqlite_file(store)
        if path is not None and not path.is_file():
            raise StoreError(f"no {path.name} in {path.parent} (was the run started with a store?)"
                             if own else f"no trajectory store at {path}")
        own = own or (path is not None and path.resolve() == (run_dir / DB_FILE).resolve())
        reader = cls(store, "", readonly=True, name=str(run_dir) if url is None else None)
        try:
            reader.run_id = read_run_identity(run_dir, reader.run_ids(), own_store=own)
        except Exception:
            reader.close()
            raise
        return reader

    # -- writes ----------------------------------------------------------------------------------

    @contextmanager
    def batch(self, background: bool = False) -> Iterator[None]:
        """add_prompts, add_samples and set_outcome inside this block write in one transaction, committed at its
        end (also when the block raises: what was written before the error is kept, as it would have been one
        call at a time): the controller writes one rollout call's prompts, samples and outcomes with one commit
        instead of one each (a commit costs more than a sample's rows). Other writes are refused inside it: they
        would wait on this transaction's lock.

        `background`: the block only builds the rows; its statements run, and commit, on the store's writer thread
        after the block, while the caller goes on (the controller's next rollout call). Every later read or other
        write first waits for them (`drain`), so the caller reads what it wrote; a checkpoint's watermark is such
        a read. A process killed before a background batch committed loses that batch's rows, as one killed a
        moment earlier would have; a resume rolls the store back to the checkpoint's watermark either way."""
        if self._batch is not None:
            raise RuntimeError("TrajectoryStore.batch() is already open")
        if background:
            yield from self._background_batch()
            return
        self.drain()
        seq, c = self._seq, self._engine.connect()
        c.begin()
        self._batch = c
        try:
            yield
        finally:
            self._batch = None
            t0 = time.perf_counter()
            try:
                c.commit()
                self.last_commit_s = time.perf_counter() - t0
            except BaseException:
                c.rollback()  # e.g. PostgreSQL after a failed statement: nothing of the block is kept
                self._seq = seq
                raise
            finally:
                c.close()

    def _background_batch(self) -> Iterator[None]:
        done = [f for f in self._pending if f.done()]  # the committed (or failed) earlier batches leave the list
        if done:
            self._pending = [f for f in self._pending if not f.done()]
            _raise_first(done)  # a failed one's error: said at the next batch, not only at the next read
        recorded = _Recorded()
        self._batch = recorded
        try:
            yield
        finally:
            self._batch = None
            self.last_commit_s = 0.0
            if recorded.ops:
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store writer")
                self._pending.append(self._writer.submit(self._run, recorded.ops))

    def _run(self, ops: list[tuple]) -> None:
        """A background batch's statements in one transaction (the writer thread). A failed one keeps nothing; the
        `seq` numbers its rows took stay unused (a gap: seq orders rows, rl/store/schema.py)."""
        t0 = time.perf_counter()
        try:
            with self._engine.begin() as c:
                for statement, parameters in ops:
                    c.execute(statement, parameters)
        finally:
            self.writer_s += time.perf_counter() - t0

    @contextmanager
    def _write(self) -> Iterator:
        """The connection a batched write uses: the open batch's (or its recorder), or a transaction of its own."""
        if self._batch is not None:
            yield self._batch
        else:
            self.drain()
            with self._engine.begin() as c:
                yield c

    def _begin(self):
        """A session in a transaction of its own, for the writes that `batch()` does not take."""
        if self._batch is not None:
            raise RuntimeError("a TrajectoryStore write other than add_prompts, add_samples and set_outcome inside "
                               "batch(): it would wait on the batch's own lock")
        self.drain()
        return self._sessions.begin()

    def add_run(self, name: str, recipe_json: str) -> None:
        """Record this run; a second call (e.g. on resume) keeps the first row."""
        with self._begin() as s:
            if s.get(RunTable, self.run_id) is None:
                s.add(RunTable(run_id=self.run_id, name=name, created_at=time.time(), recipe_json=recipe_json))

    def add_prompts(self, prompts: Sequence[Prompt]) -> None:
        """Record dispatched prompts; `dispatched_at` is the time of this call."""
        if not prompts:
            return
        now = time.time()
        rows = [
            dict(prompt_id=p.prompt_id, run_id=self.run_id, dataset=p.dataset, text=p.text,
                 tokens=encode_array(p.tokens, TOKEN_DTYPE), answer=p.answer, group_size=int(p.group_size),
                 policy_version=int(p.policy_version), dispatched_at=now, seq=self._seq + 1 + i,
                 config_version=int(p.config_version))
            for i, p in enumerate(prompts)
        ]
        with self._write() as c:  # Core on the table: the ORM's bulk-insert bookkeeping costs ~40% more here
            c.execute(PromptTable.__table__.insert(), rows)
        self._seq += len(rows)

    def set_outcome(self, prompt_ids: Sequence[str], outcome: str) -> None:
        """Record how these prompts' groups ended (see the module docstring); an outcome is final."""
        if not prompt_ids:
            return
        self._seq += 1
        with self._write() as c:
            for i in range(0, len(prompt_ids), 500):
                c.execute(update(PromptTable).where(PromptTable.run_id == self.run_id,
                                                    PromptTable.prompt_id.in_(list(prompt_ids[i : i + 500])),
                                                    PromptTable.outcome.is_(None))
                          .values(outcome=outcome, outcome_seq=self._seq))

    def add_samples(self, samples: Sequence[Sample]) -> None:
        """Record samples, their version segments and their turns in one transaction.

        Timings other than 'dispatched_at', 'finished_at' and 'generate_s' are not stored.
        """
        if not samples:
            return
        sample_rows, segment_rows, turn_rows = [], [], []
        for x in samples:
            n = len(x.response_tokens)
            if len(x.policy_versions_T) != n or len(x.behavior_logprobs_T) != n:
                raise ValueError(f"sample {x.sample_id}: per-token arrays do not match the response length")
            trace = x.routing_trace
            sample_rows.append(dict(
                sample_id=x.sample_id, run_id=self.run_id, prompt_id=x.prompt_id, dataset=x.dataset,
                group_id=x.group_id, status=x.status, reward=float(x.reward), correct=bool(x.correct),
                finish_reason=x.finish_reason, prompt_text=x.prompt_text, response_text=x.response_text,
                prompt_tokens=encode_array(x.prompt_tokens, TOKEN_DTYPE),
                response_tokens=encode_array(x.response_tokens, TOKEN_DTYPE),
                behavior_logprobs=encode_array(x.behavior_logprobs_T, LOGPROB_DTYPE),
                policy_versions=encode_array(x.policy_versions_T, VERSION_DTYPE),
                routing_trace=None if trace is None else encode_array(trace, ROUTING_DTYPE),
                routing_shape=None if trace is None else ",".join(str(d) for d in trace.shape),
                num_response_tokens=x.num_response_tokens, seq=self._seq + 1 + len(sample_rows),
                teacher=x.teacher, config_version=int(x.config_version), effort=x.effort, reason=x.reason,
                failure=x.failure, min_version=int(min(x.policy_versions_T)) if x.policy_versions_T else None,
                max_version=int(max(x.policy_versions_T)) if x.policy_versions_T else None,
                **{k: None if x.timings.get(k) is None else float(x.timings[k]) for k in _TIMING_KEYS},
            ))
            segment_rows += [
                dict(run_id=self.run_id, sample_id=x.sample_id, start=a, end=b, policy_version=v)
                for a, b, v in segments_from_versions(x.policy_versions_T)
            ]
            turn_rows += [
                dict(run_id=self.run_id, sample_id=x.sample_id, turn=i, kind=t.kind, start=t.start, end=t.end, text=t.text,
                     tool=t.tool, call=t.call, status=t.status, exit_code=t.exit_code, truncated=bool(t.truncated),
                     wall_s=None if t.wall_s is None else float(t.wall_s))
                for i, t in enumerate(x.turns)
            ]
        with self._write() as c:  # one transaction (or the batch's); Core, as add_prompts
            c.execute(SampleTable.__table__.insert(), sample_rows)
            if segment_rows:
                c.execute(SegmentTable.__table__.insert(), segment_rows)
            if turn_rows:
                c.execute(TurnTable.__table__.insert(), turn_rows)
        self._seq += len(sample_rows)

    def mark_trained(self, sample_ids: Sequence[str], step: int) -> None:
        """Stamp `step` on the samples the trainer consumed. Raises, marking nothing, if any id is
        unknown or already trained: a sample is trained at most once."""
        ids = list(dict.fromkeys(sample_ids))
        if len(ids) != len(sample_ids):
            raise ValueError("mark_trained: the same sample id appears twice in one train step")
        if not ids:  # an executemany of no rows is an INSERT of DEFAULT VALUES (NULL ids): nothing to stamp
            return
        matched = 0
        with self._begin() as s:
            for i in range(0, len(ids), 500):  # stay under the backends' bound-parameter limits
                chunk = ids[i : i + 500]
                matched += s.execute(
                    update(SampleTable)
                    .where(SampleTable.run_id == self.run_id, SampleTable.sample_id.in_(chunk),
                           SampleTable.train_step.is_(None))
                    .values(train_step=int(step))
                ).rowcount
            if matched != len(ids):
                raise ValueError(f"mark_trained: {len(ids) - matched} of {len(ids)} sample ids are unknown or already trained")
            s.execute(insert(TrainedTable), [dict(run_id=self.run_id, sample_id=i, step=int(step)) for i in ids])

    def add_train_step(self, step: int, metrics: dict) -> None:
        """Record one optimizer step's metrics (a repeated step, after resume, overwrites)."""
        metrics_json = json.dumps(metrics, sort_keys=True, default=float)  # default: numpy scalars
        with self._begin() as s:
            row = TrainStepTable(run_id=self.run_id, step=int(step), created_at=time.time(), metrics_json=metrics_json)
            s.merge(row)

    def add_config_version(self, version: int | None, status: str, patch: dict, train_step: int,
                           reason: str | None = None) -> None:
        """Record a live reconfiguration (applied: the version it created; refused: why)."""
        self._seq += 1
        with self._begin() as s:
            s.add(ConfigVersionTable(run_id=self.run_id, version=version, status=status, patch_json=json.dumps(patch),
                                     reason=reason, train_step=int(train_step), created_at=time.time(), seq=self._seq))

    def config_versions(self) -> list[dict]:
        with self._session() as s:
            rows = s.scalars(select(ConfigVersionTable).where(ConfigVersionTable.run_id == self.run_id)
                             .order_by(ConfigVersionTable.id))
            return [{"version": r.version, "status": r.status, "patch": json.loads(r.patch_json), "reason": r.reason,
                     "train_step": r.train_step} for r in rows]

    def set_teacher(self, sample_ids: Sequence[str], teacher: str) -> None:
        """Re-assign samples to the teacher that actually scores them (their own one was removed)."""
        with self._begin() as s:
            for i in range(0, len(sample_ids), 500):  # stay under the backends' bound-parameter limits
                s.execute(update(SampleTable).where(SampleTable.run_id == self.run_id,
                                                    SampleTable.sample_id.in_(list(sample_ids[i : i + 500])))
                          .values(teacher=teacher))

    def watermark(self, train_step: int) -> Watermark:
        """Where the store stands now, for a checkpoint: every row numbered so far is committed first (the
        background batches drained), so that a resume's `rollback_to` keeps exactly what the checkpoint saw."""
        self.drain()
        return Watermark(self._seq, int(train_step))

    def rollback_to(self, wm: Watermark, checkpoint: str) -> dict[str, int]:
        """Undo what was written after `wm` (see the module docstring), in one transaction; returns and
        records the counts."""
        P, S, t, G = PromptTable, SampleTable, TrainStepTable, SegmentTable
        with self._begin() as s:
            # Rows that reference samples go first (the database checks the references).
            s.execute(delete(TrainedTable).where(TrainedTable.run_id == self.run_id, TrainedTable.step > wm.train_step))
            late_samples = select(S.sample_id).where(S.run_id == self.run_id, S.seq > wm.seq)
            s.execute(delete(G).where(G.run_id == self.run_id, G.sample_id.in_(late_samples)))
            s.execute(delete(TurnTable).where(TurnTable.run_id == self.run_id, TurnTable.sample_id.in_(late_samples)))
            counts = dict(
                samples_regenerated=s.execute(delete(S).where(S.run_id == self.run_id, S.seq > wm.seq)).rowcount,
                prompts_redispatched=s.execute(delete(P).where(P.run_id == self.run_id, P.seq > wm.seq)).rowcount,
                samples_untrained=s.execute(update(S).where(S.run_id == self.run_id, S.train_step > wm.train_step)
                                            .values(train_step=None)).rowcount,
                train_steps_rolled_back=s.execute(delete(t).where(t.run_id == self.run_id, t.step > wm.train_step)).rowcount,
            )
            # the restored controller applies the answered patches again; a refused one is never retried: its row stays
            s.execute(delete(ConfigVersionTable).where(ConfigVersionTable.run_id == self.run_id, ConfigVersionTable.seq > wm.seq,
                                                       ConfigVersionTable.status == "applied"))
            s.execute(update(P).where(P.run_id == self.run_id, P.outcome_seq > wm.seq).values(outcome=None, outcome_seq=None))
            s.add(RestartTable(run_id=self.run_id, restarted_at=time.time(), checkpoint=checkpoint,
                               train_step=wm.train_step, **counts))
        self._seq = wm.seq
        return counts

    def record_checkpoint(self, token: str, checkpoint: str, train_step: int) -> None:
        """Record a committed checkpoint's lineage token (rl/store/identity.py); joins an open batch's transaction."""
        row = dict(run_id=self.run_id, token=token, checkpoint=checkpoint, train_step=int(train_step), seq=self._seq,
                   created_at=time.time())
        with self._write() as c:
            c.execute(CheckpointTable.__table__.insert(), [row])

    def newest_checkpoint(self) -> dict | None:
        """The last checkpoint row recorded for this run (token, checkpoint, train_step), or None."""
        K = CheckpointTable
        with self._session() as s:
            row = s.execute(select(K.token, K.checkpoint, K.train_step).where(K.run_id == self.run_id)
                            .order_by(K.id.desc()).limit(1)).mappings().first()
        return None if row is None else dict(row)

    def last_train_step(self) -> int | None:
        """The highest train step this run has recorded, or None."""
        with self._session() as s:
            return s.scalar(select(func.max(TrainStepTable.step)).where(TrainStepTable.run_id == self.run_id))

    def fork(self, run_id: str, wm: Watermark) -> dict[str, int]:
        """Copy this run's rows up to the watermark `wm` into the new run `run_id`, in one transaction, and write as
        that run from now on: a copy of the run directory resumed as a run of its own (`rl resume --new-identity`),
        its history the same up to its checkpoint, the original's rows untouched. Rows past `wm` that the copy's
        checkpoint still sees as later (a sample's `train_step`, a prompt's outcome) are reset by `rollback_to`, as
        for any resume; its checkpoint lineage and restarts start empty. Returns the rows copied per table."""
        P, S, G, U, T, D, C = (PromptTable, SampleTable, SegmentTable, TurnTable, TrainStepTable, TrainedTable,
                               ConfigVersionTable)
        kept = select(S.sample_id).where(S.run_id == self.run_id, S.seq <= wm.seq)
        copies = [  # (table, the old run's rows to copy); referenced samples before the rows that reference them
            (P, P.seq <= wm.seq), (S, S.seq <= wm.seq), (G, G.sample_id.in_(kept)), (U, U.sample_id.in_(kept)),
            (T, T.step <= wm.train_step), (D, (D.step <= wm.train_step) & D.sample_id.in_(kept)), (C, C.seq <= wm.seq),
        ]
        counts = {}
        with self._begin() as s:
            old = s.get(RunTable, self.run_id)
            s.add(RunTable(run_id=run_id, name=old.name if old else run_id, created_at=time.time(),
                           recipe_json=old.recipe_json if old else "{}"))
            s.flush()
            for model, where in copies:
                table = model.__table__
                cols = [c for c in table.c if c.name != "id"]  # config_versions' surrogate id: the new row's own
                source = select(*[literal(run_id, type_=c.type).label("run_id") if c.name == "run_id" else c for c in cols])
                counts[table.name] = s.execute(insert(table).from_select([c.name for c in cols],
                                                                         source.where(table.c.run_id == self.run_id, where))
                                               ).rowcount
        self.run_id = run_id
        self._seq = self._last_seq()
        return counts

    # -- reads -----------------------------------------------------------------------------------

    def get_sample(self, sample_id: str) -> Sample | None:
        """The full record back, or None. Logprobs come back float32-rounded."""
        with self._session() as s:
            r = s.get(SampleTable, (self.run_id, sample_id))
            turns = [] if r is None else s.scalars(select(TurnTable).where(TurnTable.run_id == self.run_id,
                                                                           TurnTable.sample_id == sample_id)
                                                   .order_by(TurnTable.turn)).all()
        if r is None:
            return None
        trace = None
        if r.routing_trace is not None:
            shape = tuple(int(d) for d in r.routing_shape.split(","))
            trace = decode_array(r.routing_trace, ROUTING_DTYPE, shape)
        timings = {k: getattr(r, k) for k in _TIMING_KEYS if getattr(r, k) is not None}
        return Sample(
            sample_id=r.sample_id, prompt_id=r.prompt_id, dataset=r.dataset, group_id=r.group_id,
            prompt_tokens=tuple(decode_array(r.prompt_tokens, TOKEN_DTYPE).tolist()),
            response_tokens=tuple(decode_array(r.response_tokens, TOKEN_DTYPE).tolist()),
            prompt_text=r.prompt_text, response_text=r.response_text,
            behavior_logprobs_T=tuple(decode_array(r.behavior_logprobs, LOGPROB_DTYPE).tolist()),
            policy_versions_T=tuple(decode_array(r.policy_versions, VERSION_DTYPE).tolist()),
            reward=r.reward, correct=r.correct, finish_reason=r.finish_reason, status=r.status,
            timings=timings, routing_trace=trace, teacher=r.teacher, config_version=r.config_version,
            effort=r.effort, reason=r.reason or "", failure=r.failure,
            turns=tuple(Turn(kind=t.kind, start=t.start, end=t.end, text=t.text, tool=t.tool, call=t.call, status=t.status,
                             exit_code=t.exit_code, truncated=t.truncated, wall_s=t.wall_s) for t in turns),
        )

    def read(self, fn: Callable[[Session], T]) -> T:
        """`fn(session)` in one short read transaction (the dashboard's reads, rl/ui/data.py)."""
        with self._session() as s:
            return fn(s)

    def sample_train_step(self, sample_id: str) -> int | None:
        """The step that consumed the sample; None if untrained (or unknown)."""
        with self._session() as s:
            return s.scalar(select(SampleTable.train_step).where(SampleTable.run_id == self.run_id,
                                                                 SampleTable.sample_id == sample_id))

    def segments(self, sample_id: str) -> list[tuple[int, int, int]]:
        """(start, end, policy_version) over the response tokens, in order."""
        q = (select(SegmentTable.start, SegmentTable.end, SegmentTable.policy_version)
             .where(SegmentTable.run_id == self.run_id, SegmentTable.sample_id == sample_id).order_by(SegmentTable.start))
        with self._session() as s:
            return [tuple(row) for row in s.execute(q)]

    def train_step_metrics(self, step: int) -> dict | None:
        with self._session() as s:
            row = s.get(TrainStepTable, (self.run_id, step))
        return None if row is None else json.loads(row.metrics_json)

    def query(
        self,
        *,
        dataset: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        train_step: int | None = None,
        status: str | None = None,
        effort: int | None = None,
        teacher: str | None = None,
        failure: str | None = None,
        limit: int = 50,
    ) -> list[SampleRow]:
        """This run's samples matching every given filter (reward bounds inclusive), oldest first."""
        t = SampleTable
        q = select(
            t.sample_id, t.prompt_id, t.dataset, t.reward, t.correct, t.num_response_tokens,
            t.min_version, t.max_version, t.train_step, t.status,
            func.substr(t.response_text, 1, PREVIEW_CHARS),
        ).where(t.run_id == self.run_id)
        if dataset is not None:
            q = q.where(t.dataset == dataset)
        if min_reward is not None:
            q = q.where(t.reward >= min_reward)
        if max_reward is not None:
            q = q.where(t.reward <= max_reward)
        if train_step is not None:
            q = q.where(t.train_step == train_step)
        if status is not None:
            q = q.where(t.status == status)
        if effort is not None:
            q = q.where(t.effort == effort)
        if teacher is not None:
            q = q.where(t.teacher == teacher)
        if failure is not None:
            q = q.where(t.failure == failure)
        q = q.order_by(t.finished_at, t.sample_id).limit(limit)
        with self._session() as s:
            return [SampleRow(*row) for row in s.execute(q)]

    def count_samples(self) -> int:
        with self._session() as s:
            return s.scalar(select(func.count()).select_from(SampleTable).where(SampleTable.run_id == self.run_id))

    def count_train_steps(self) -> int:
        """Train steps this run has recorded (GRPO/OPD steps)."""
        with self._session() as s:
            return s.scalar(select(func.count()).select_from(TrainStepTable).where(TrainStepTable.run_id == self.run_id))

    def run_ids(self) -> list[str]:
        """Every run id recorded in this database (one, for a run directory's own file). The samples' ids are read
        as a skip scan, one index seek a run (`min(run_id) > the last`): a DISTINCT or UNION walks the whole run_id
        index, ~100 ms at 1M samples, and every reader opening a run directory asks (`read_run`)."""
        with self._session() as s:
            ids = set(s.scalars(select(RunTable.run_id)))
            last = s.scalar(select(func.min(SampleTable.run_id)))
            while last is not None:
                ids.add(last)
                last = s.scalar(select(func.min(SampleTable.run_id)).where(SampleTable.run_id > last))
            return sorted(ids)

    def restarts(self) -> list[dict]:
        with self._session() as s:
            rows = s.scalars(select(RestartTable).where(RestartTable.run_id == self.run_id).order_by(RestartTable.id))
            return [{c: getattr(r, c) for c in ("checkpoint", "train_step", "prompts_redispatched", "samples_regenerated",
                                                "samples_untrained", "train_steps_rolled_back")} for r in rows]

    def audit(self) -> dict[str, int]:
        """Consistency counts for resume checks: samples consumed by more than one train step,
        trained samples whose `train_step` disagrees with the audit table, prompts without an outcome."""
        S, T, P = SampleTable, TrainedTable, PromptTable
        with self._session() as s:
            twice = s.scalar(select(func.count()).select_from(
                select(T.sample_id).where(T.run_id == self.run_id).group_by(T.sample_id).having(func.count() > 1).subquery()))
            trained = s.scalar(select(func.count()).select_from(S).where(S.run_id == self.run_id, S.train_step.is_not(None)))
            agree = s.scalar(select(func.count()).select_from(S)
                             .join(T, (T.run_id == S.run_id) & (T.sample_id == S.sample_id) & (T.step == S.train_step))
                             .where(S.run_id == self.run_id))
            open_ = s.scalar(select(func.count()).select_from(P).where(P.run_id == self.run_id, P.outcome.is_(None)))
            prompts = s.scalar(select(func.count()).select_from(P).where(P.run_id == self.run_id))
        return {"trained_twice": twice, "trained": trained, "link_mismatch": trained - agree, "prompts": prompts,
                "prompts_open": open_}

    def close(self) -> None:
        """Wait for the background batches (a failed one's error is raised after the store is closed), then close."""
        try:
            self.drain()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            self._engine.dispose()

"""The trajectory store's tables at the newest schema revision (rl/store/migrations/versions/ gets a
database there; rl/store/trajectories.py reads and writes it). Many runs share one database: every row carries
its `run_id`, and every key that a run chooses (prompt, sample ids) is unique only within the run,
so keys are (run_id, id); the surrogate ids of `config_versions` and `restarts` are global.

Changing a table here needs a new revision in rl/store/migrations/versions/ that brings an existing
database to the same shape; tests/unit/test_store_migrations.py checks that a migrated database and
one made from these classes are identical.
"""

from __future__ import annotations

from sqlalchemy import (Boolean, Float, ForeignKeyConstraint, Index, LargeBinary, PrimaryKeyConstraint, String, Text,
                        text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

_ID = String(255)


class Base(DeclarativeBase):
    pass


class RunTable(Base):
    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(_ID, primary_key=True)
    """The run's identity: a UUID kept in RUN_DIR/run.json (rl/store/identity.py); older runs: the directory name."""
    name: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    recipe_json: Mapped[str] = mapped_column(Text)


class PromptTable(Base):
    __tablename__ = "prompts"
    __table_args__ = (PrimaryKeyConstraint("run_id", "prompt_id", name="pk_prompts"),)
    prompt_id: Mapped[str] = mapped_column(_ID)
    run_id: Mapped[str] = mapped_column(_ID, index=True)
    dataset: Mapped[str] = mapped_column(_ID)
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[bytes] = mapped_column(LargeBinary)
    answer: Mapped[str] = mapped_column(Text)
    group_size: Mapped[int]
    policy_version: Mapped[int]
    dispatched_at: Mapped[float] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(index=True)
    """Write order within the run (the resume watermark compares against it)."""
    config_version: Mapped[int] = mapped_column(default=0)
    outcome: Mapped[str | None] = mapped_column(String(32))
    """NULL while open; trained | discarded | dropped_stale | filtered | dropped_stage_end."""
    outcome_seq: Mapped[int | None]


BROWSE_COLUMNS = ("dataset", "train_step", "reward", "correct", "finish_reason", "failure", "effort", "teacher", "status",
                  "min_version", "max_version")
"""The columns the dashboard's samples table filters on (rl/ui/data.py): each browse index carries them all."""
BROWSE_KEYS = {"seq": "seq", "reward": "reward", "step": "train_step", "length": "num_response_tokens"}
"""The samples table's sort keys stored as columns (the version lag is an expression: `LAG_INDEX`)."""
BROWSE_INDEXES = {f"ix_samples_browse_{k}": ("run_id", c, *(("seq",) if c != "seq" else ()),
                                              *(b for b in BROWSE_COLUMNS if b != c))
                  for k, c in BROWSE_KEYS.items()}
"""Revision 0008's covering indexes, one per sort key: (run_id, key, seq, every filter column). A page of the samples
table, under any filter and sort, walks one of them alone, never a row of the table (whose scalar columns SQLite
stores past its token arrays) and never a sort: at 1M samples a walk of the whole run is ~100 ms on a 2-core CPU,
where revision 0007's (run_id, key, seq) indexes read each walked row's filter columns from the table (rl/ui/data.py;
rl/store/migrations/versions/0008_covering_browse_indexes.py)."""
LAG_INDEX = "ix_samples_browse_lag"
LAG = "(max_version - min_version)"
"""The version lag's key: an index on the expression (run_id, lag, seq, every filter column)."""


class SampleTable(Base):
    __tablename__ = "samples"
    __table_args__ = (PrimaryKeyConstraint("run_id", "sample_id", name="pk_samples"),
                      *(Index(name, *cols) for name, cols in BROWSE_INDEXES.items()),
                      Index(LAG_INDEX, "run_id", text(LAG), "seq", *BROWSE_COLUMNS))
    sample_id: Mapped[str] = mapped_column(_ID)
    run_id: Mapped[str] = mapped_column(_ID, index=True)
    prompt_id: Mapped[str] = mapped_column(_ID, index=True)
    dataset: Mapped[str] = mapped_column(_ID, index=True)
    group_id: Mapped[str] = mapped_column(_ID)
    status: Mapped[str] = mapped_column(String(32))
    reward: Mapped[float] = mapped_column(Float, index=True)
    correct: Mapped[bool]
    finish_reason: Mapped[str] = mapped_column(String(32))
    prompt_text: Mapped[str] = mapped_column(Text)
    response_text: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[bytes] = mapped_column(LargeBinary)
    response_tokens: Mapped[bytes] = mapped_column(LargeBinary)
    behavior_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    policy_versions: Mapped[bytes] = mapped_column(LargeBinary)
    routing_trace: Mapped[bytes | None] = mapped_column(LargeBinary)
    routing_shape: Mapped[str | None] = mapped_column(String(64))
    num_response_tokens: Mapped[int]
    # NULL only for an empty response (e.g. a sample that failed before its first token).
    min_version: Mapped[int | None]
    max_version: Mapped[int | None]
    dispatched_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    generate_s: Mapped[float | None] = mapped_column(Float)
    train_step: Mapped[int | None] = mapped_column(index=True)
    teacher: Mapped[str | None] = mapped_column(_ID, index=True)
    config_version: Mapped[int] = mapped_column(default=0)
    effort: Mapped[int | None] = mapped_column(index=True)
    """Effort level b of the prompt (seed §5.1.4); NULL without effort control."""
    reason: Mapped[str | None] = mapped_column(Text)
    """The verifier's reason for the reward (rewards.task.Verdict.reason); NULL before revision 0003."""
    failure: Mapped[str | None] = mapped_column(String(32), index=True)
    """Repercussion (rl/algo/repercussion.py): why a tool call's sandbox failed and ended the sample; NULL: none (or
    stored before revision 0005)."""
    seq: Mapped[int] = mapped_column(index=True)
    """Write order within the run (the resume watermark compares against it)."""


class SegmentTable(Base):
    __tablename__ = "segments"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "sample_id", "start", name="pk_segments"),
        ForeignKeyConstraint(["run_id", "sample_id"], ["samples.run_id", "samples.sample_id"], name="fk_segments_samples"),
    )
    run_id: Mapped[str] = mapped_column(_ID)
    sample_id: Mapped[str] = mapped_column(_ID)
    start: Mapped[int]
    end: Mapped[int]
    policy_version: Mapped[int]


class TurnTable(Base):
    """One row per turn of a multi-turn sample (rl.types.Turn), revision 0004; single-turn samples have none."""

    __tablename__ = "turns"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "sample_id", "turn", name="pk_turns"),
        ForeignKeyConstraint(["run_id", "sample_id"], ["samples.run_id", "samples.sample_id"], name="fk_turns_samples"),
    )
    run_id: Mapped[str] = mapped_column(_ID)
    sample_id: Mapped[str] = mapped_column(_ID)
    turn: Mapped[int] = mapped_column(autoincrement=False)
    """Index of the turn in the sample, from 0."""
    kind: Mapped[str] = mapped_column(String(8))
    """model | tool"""
    start: Mapped[int]
    end: Mapped[int]
    """[start, end) in response-token indices."""
    text: Mapped[str] = mapped_column(Text)
    """model: the turn's text; tool: the output as the model saw it."""
    tool: Mapped[str | None] = mapped_column(_ID)
    call: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str | None] = mapped_column(String(32), index=True)
    """Tool turns: ok | error | timeout | sandbox_failed | parse_error."""
    exit_code: Mapped[int | None]
    truncated: Mapped[bool] = mapped_column(Boolean)
    wall_s: Mapped[float | None] = mapped_column(Float)


class TrainStepTable(Base):
    __tablename__ = "train_steps"
    run_id: Mapped[str] = mapped_column(_ID, primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    created_at: Mapped[float] = mapped_column(Float)
    metrics_json: Mapped[str] = mapped_column(Text)


class TrainedTable(Base):
    __tablename__ = "trained"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "sample_id"], ["samples.run_id", "samples.sample_id"], name="fk_trained_samples"),
    )
    run_id: Mapped[str] = mapped_column(_ID, primary_key=True)
    sample_id: Mapped[str] = mapped_column(_ID, primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)


class ConfigVersionTable(Base):
    __tablename__ = "config_versions"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_ID, index=True)
    version: Mapped[int | None]
    """The version an applied patch created; NULL for a refused one."""
    status: Mapped[str] = mapped_column(String(16))
    patch_json: Mapped[str] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    train_step: Mapped[int]
    created_at: Mapped[float] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(index=True)


class RestartTable(Base):
    __tablename__ = "restarts"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_ID, index=True)
    restarted_at: Mapped[float] = mapped_column(Float)
    checkpoint: Mapped[str] = mapped_column(Text)
    train_step: Mapped[int]
    """The checkpoint's train step: the job continues with step train_step + 1."""
    prompts_redispatched: Mapped[int]
    samples_regenerated: Mapped[int]
    samples_untrained: Mapped[int]
    train_steps_rolled_back: Mapped[int]


class CheckpointTable(Base):
    """One row per checkpoint a job of the run committed, with the lineage token its run directory's run.json also
    keeps (rl/store/identity.py): a resume whose directory never wrote the store's newest row is a copy of the run
    directory that fell behind, and is refused rather than rolling the run back (rl/algo/resume.py). Revision 0006."""

    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_ID, index=True)
    token: Mapped[str] = mapped_column(String(64))
    """Random, new for every checkpoint written (never derived from the directory's name or contents)."""
    checkpoint: Mapped[str] = mapped_column(Text)
    """The checkpoint directory's name, e.g. step-00000008-000."""
    train_step: Mapped[int]
    seq: Mapped[int]
    """The run's write counter at the checkpoint (its watermark)."""
    created_at: Mapped[float] = mapped_column(Float)

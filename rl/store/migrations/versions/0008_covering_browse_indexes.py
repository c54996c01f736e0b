"""Covering indexes for the dashboard's samples table (issue #45 item 4: 1M samples, any filter and sort, a page at a
deep offset in <= 200 ms).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

Revision 0007's (run_id, key, seq) indexes ordered a page, but a filter on another column read every walked row from
the table, whose scalar columns SQLite stores after the token arrays (overflow pages): `finish_reason = 'length'`
sorted by step took 481-625 ms a page at 200K samples of 1K tokens. Here each sort key gets one index that also
carries every column the table filters on: (run_id, key, seq, dataset, train_step, reward, correct, finish_reason,
failure, effort, teacher, status, min_version, max_version). A page walks one of them and nothing else; the
per-filter indexes of 0007 go (the dashboard no longer uses them: one index fewer a filter for the writer).
Building them reads the samples table once an index: minutes for a store of tens of GB.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

OLD = ("ix_samples_run_seq", "ix_samples_run_reward_seq", "ix_samples_run_step_seq", "ix_samples_run_length_seq",
       "ix_samples_run_dataset_seq", "ix_samples_run_teacher_seq", "ix_samples_run_effort_seq",
       "ix_samples_run_failure_seq", "ix_samples_run_finish_seq", "ix_samples_run_lag_seq")
"""Revision 0007's indexes."""
COLUMNS = ["dataset", "train_step", "reward", "correct", "finish_reason", "failure", "effort", "teacher", "status",
           "min_version", "max_version"]
INDEXES = {
    "ix_samples_browse_seq": ["run_id", "seq", *COLUMNS],
    "ix_samples_browse_reward": ["run_id", "reward", "seq", *(c for c in COLUMNS if c != "reward")],
    "ix_samples_browse_step": ["run_id", "train_step", "seq", *(c for c in COLUMNS if c != "train_step")],
    "ix_samples_browse_length": ["run_id", "num_response_tokens", "seq", *COLUMNS],
}
"""Name -> columns, as of this revision (a migration never imports the models: they move on); rl/store/schema.py
`BROWSE_INDEXES` declares the same (tests/unit/test_store_migrations.py compares the two)."""
LAG = "ix_samples_browse_lag"
"""(run_id, max_version - min_version, seq, COLUMNS): the version lag, an expression."""


def upgrade() -> None:
    for name in OLD:
        op.drop_index(name, "samples")
    for name, columns in INDEXES.items():
        op.create_index(name, "samples", columns)
    op.create_index(LAG, "samples", ["run_id", sa.text("(max_version - min_version)"), "seq", *COLUMNS])


def downgrade() -> None:
    op.drop_index(LAG, "samples")
    for name in INDEXES:
        op.drop_index(name, "samples")
    for name, columns in {"ix_samples_run_seq": ["run_id", "seq"], "ix_samples_run_reward_seq": ["run_id", "reward", "seq"],
                          "ix_samples_run_step_seq": ["run_id", "train_step", "seq"],
                          "ix_samples_run_length_seq": ["run_id", "num_response_tokens", "seq"],
                          "ix_samples_run_dataset_seq": ["run_id", "dataset", "seq"],
                          "ix_samples_run_teacher_seq": ["run_id", "teacher", "seq"],
                          "ix_samples_run_effort_seq": ["run_id", "effort", "seq"],
                          "ix_samples_run_failure_seq": ["run_id", "failure", "seq"],
                          "ix_samples_run_finish_seq": ["run_id", "finish_reason", "seq"]}.items():
        op.create_index(name, "samples", columns)
    op.create_index("ix_samples_run_lag_seq", "samples", ["run_id", sa.text("(max_version - min_version)"), "seq"])

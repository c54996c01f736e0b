"""Composite indexes for browsing a run's samples page by page (issue #45: `rl ui`'s samples table).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

A page at a deep offset, `WHERE run_id = ? [AND col = ?] ORDER BY key, seq LIMIT 50 OFFSET n`, walked the run_id
index and sorted every row of the run in a temporary B-tree, reading each row's sort key from past its token arrays
(overflow pages): ~1 s a page at 200K samples of 1K tokens. With (run_id, key, seq) the page is an index walk: 1-26 ms
there (BENCHMARKS.md). One index per sort key of the dashboard (write order, reward, train step, length) and per
filter it pages in write order (dataset, teacher, effort, failure, finish reason), and one on the version lag
(max_version - min_version); each costs the writer one small B-tree insert a sample.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

INDEXES = {
    "ix_samples_run_seq": ["run_id", "seq"],
    "ix_samples_run_reward_seq": ["run_id", "reward", "seq"],
    "ix_samples_run_step_seq": ["run_id", "train_step", "seq"],
    "ix_samples_run_length_seq": ["run_id", "num_response_tokens", "seq"],
    "ix_samples_run_dataset_seq": ["run_id", "dataset", "seq"],
    "ix_samples_run_teacher_seq": ["run_id", "teacher", "seq"],
    "ix_samples_run_effort_seq": ["run_id", "effort", "seq"],
    "ix_samples_run_failure_seq": ["run_id", "failure", "seq"],
    "ix_samples_run_finish_seq": ["run_id", "finish_reason", "seq"],
}
"""Name -> columns, as of this revision (a migration never imports the models: they move on); rl/store/schema.py
`BROWSE_INDEXES` declares the same (tests/unit/test_store_migrations.py compares the two)."""


LAG = "ix_samples_run_lag_seq"
"""(run_id, max_version - min_version, seq): the version lag, an expression."""


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "samples", columns)
    op.create_index(LAG, "samples", ["run_id", sa.text("(max_version - min_version)"), "seq"])


def downgrade() -> None:
    op.drop_index(LAG, "samples")
    for name in INDEXES:
        op.drop_index(name, "samples")

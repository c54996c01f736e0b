"""Checkpoints leave a lineage token in the store (issue #40, class 6): a copy of a run directory that fell behind
a shared store is told from the run that wrote it, and its resume refused instead of rolling the run back.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

- checkpoints: new table, one row per committed checkpoint (run_id, token, checkpoint name, train step, seq,
  created_at) under a global surrogate id; runs checkpointed before this revision have none (their first resume
  is not checked).
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("checkpoint", sa.Text(), nullable=False),
        sa.Column("train_step", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_checkpoints_run_id", "checkpoints", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_run_id", "checkpoints")
    op.drop_table("checkpoints")

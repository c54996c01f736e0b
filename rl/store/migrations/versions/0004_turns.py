"""Multi-turn samples keep their turns (issue #16: tool calls): model spans and tool spans with the call,
its status, exit code, output, truncation and wall time.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

- turns: new table, one row per (run_id, sample_id, turn), referencing samples (run_id, sample_id);
  samples stored before this revision (all single-turn) have no rows.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

ID = sa.String(255)


def upgrade() -> None:
    op.create_table(
        "turns",
        sa.Column("run_id", ID, nullable=False), sa.Column("sample_id", ID, nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False), sa.Column("end", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tool", ID, nullable=True), sa.Column("call", sa.Text(), nullable=True),
        sa.Column("status", sa.String(32), nullable=True), sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("truncated", sa.Boolean(), nullable=False), sa.Column("wall_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "sample_id", "turn", name="pk_turns"),
        sa.ForeignKeyConstraint(["run_id", "sample_id"], ["samples.run_id", "samples.sample_id"], name="fk_turns_samples"),
    )
    op.create_index("ix_turns_status", "turns", ["status"])


def downgrade() -> None:
    op.drop_index("ix_turns_status", "turns")
    op.drop_table("turns")

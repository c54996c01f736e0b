"""Samples keep their verdict's reason (rewards.task.Verdict.reason: why the verifier scored them so).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

- samples: gains `reason` (text, NULL for samples stored before this revision).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("samples", sa.Column("reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("samples", "reason")

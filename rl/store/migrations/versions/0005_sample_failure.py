"""Samples keep the repercussion of a failed tool call (issue #16, item 3; seed §5.1.3): the reason a sandbox
failure ended the sample (timeout, cpu, memory, processes, output_truncated, crashed, refused, sandbox_error).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

- samples: gains `failure` (varchar 32, indexed; NULL: no failure, and for samples stored before this revision).
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("samples", sa.Column("failure", sa.String(32), nullable=True))
    op.create_index("ix_samples_failure", "samples", ["failure"])


def downgrade() -> None:
    op.drop_index("ix_samples_failure", "samples")
    op.drop_column("samples", "failure")

"""Run-scoped keys: many runs in one database may reuse prompt and sample ids.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

- prompts: primary key prompt_id -> (run_id, prompt_id); samples: sample_id -> (run_id, sample_id).
- segments: gains run_id (its sample's), key (run_id, sample_id, start) instead of a surrogate id,
  and references samples (run_id, sample_id).
- trained: references samples (run_id, sample_id).

At 0001 a sample id is unique in the whole database, so each segment's run is its sample's. SQLite
cannot alter keys in place: those tables are copied (Alembic batch mode), which takes as long as
copying the file; PostgreSQL alters them in place. The whole revision runs in one transaction.
"""

import warnings

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = sa.String(255)


def upgrade() -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    if not sqlite:  # the old segments -> samples(sample_id) reference pins samples' old key
        for fk in sa.inspect(bind).get_foreign_keys("segments"):
            op.drop_constraint(fk["name"], "segments", type_="foreignkey")
    _replace_primary_key("samples", ["run_id", "sample_id"], sqlite)
    _replace_primary_key("prompts", ["run_id", "prompt_id"], sqlite)

    op.create_table(
        "segments_0002",
        sa.Column("run_id", ID, nullable=False), sa.Column("sample_id", ID, nullable=False),
        sa.Column("start", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("end", sa.Integer(), nullable=False), sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "sample_id", "start", name="pk_segments"),
        sa.ForeignKeyConstraint(["run_id", "sample_id"], ["samples.run_id", "samples.sample_id"],
                                name="fk_segments_samples"),
    )
    old = sa.table("segments", sa.column("sample_id"), sa.column("start"), sa.column("end"), sa.column("policy_version"))
    samples = sa.table("samples", sa.column("run_id"), sa.column("sample_id"))
    new = sa.table("segments_0002", *(sa.column(c) for c in ("run_id", "sample_id", "start", "end", "policy_version")))
    # An inner join: a segment whose sample is gone (none should exist) has no run to belong to.
    op.execute(new.insert().from_select(
        ["run_id", "sample_id", "start", "end", "policy_version"],
        sa.select(samples.c.run_id, old.c.sample_id, old.c.start, old.c.end, old.c.policy_version)
        .select_from(old.join(samples, samples.c.sample_id == old.c.sample_id))))
    op.drop_table("segments")  # with its index ix_segments_sample_id (the new key leads with the sample)
    op.rename_table("segments_0002", "segments")

    if sqlite:
        with op.batch_alter_table("trained", recreate="always") as batch:
            batch.create_foreign_key("fk_trained_samples", "samples", ["run_id", "sample_id"], ["run_id", "sample_id"])
    else:
        op.create_foreign_key("fk_trained_samples", "trained", "samples", ["run_id", "sample_id"], ["run_id", "sample_id"])


def _replace_primary_key(table: str, columns: list[str], sqlite: bool) -> None:
    if not sqlite:
        op.drop_constraint(sa.inspect(op.get_bind()).get_pk_constraint(table)["name"], table, type_="primary")
        op.create_primary_key(f"pk_{table}", table, columns)
        return
    with warnings.catch_warnings():
        # The copy's reflected id column still says primary_key=True; SQLAlchemy warns, then (as
        # wanted) makes `columns` the key.
        warnings.filterwarnings("ignore", message=".*specifies columns .* as primary_key=True")
        with op.batch_alter_table(table, recreate="always") as batch:
            batch.create_primary_key(f"pk_{table}", columns)


def downgrade() -> None:
    raise NotImplementedError("run-scoped keys cannot become global again once two runs share ids; restore a backup")

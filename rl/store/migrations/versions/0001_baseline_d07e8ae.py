"""Baseline: the store exactly as commit d07e8ae's `create_all` made it (global prompt and sample ids).

Revision ID: 0001
Revises: -
Create Date: 2026-11-30

A database written before stores were versioned has these tables but no `alembic_version`; this
revision adopts it instead of creating anything: a store from before commit 5aa29a3 lacks
`samples.effort` (added here, NULL: those runs had no effort control), one from d07e8ae is the
baseline as it is. Any other unversioned layout is refused, changing nothing.
"""

import sqlalchemy as sa
from alembic import op

from rl.store.db import StoreError

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(255)
# Every table and column of d07e8ae, in its order; `(name, type, nullable)`.
TABLES = {
    "runs": [("run_id", ID, False), ("name", sa.Text(), False), ("created_at", sa.Float(), False),
             ("recipe_json", sa.Text(), False)],
    "prompts": [("prompt_id", ID, False), ("run_id", ID, False), ("dataset", ID, False), ("text", sa.Text(), False),
                ("tokens", sa.LargeBinary(), False), ("answer", sa.Text(), False), ("group_size", sa.Integer(), False),
                ("policy_version", sa.Integer(), False), ("dispatched_at", sa.Float(), False),
                ("seq", sa.Integer(), False), ("config_version", sa.Integer(), False), ("outcome", sa.String(32), True),
                ("outcome_seq", sa.Integer(), True)],
    "samples": [("sample_id", ID, False), ("run_id", ID, False), ("prompt_id", ID, False), ("dataset", ID, False),
                ("group_id", ID, False), ("status", sa.String(32), False), ("reward", sa.Float(), False),
                ("correct", sa.Boolean(), False), ("finish_reason", sa.String(32), False),
                ("prompt_text", sa.Text(), False), ("response_text", sa.Text(), False),
                ("prompt_tokens", sa.LargeBinary(), False), ("response_tokens", sa.LargeBinary(), False),
                ("behavior_logprobs", sa.LargeBinary(), False), ("policy_versions", sa.LargeBinary(), False),
                ("routing_trace", sa.LargeBinary(), True), ("routing_shape", sa.String(64), True),
                ("num_response_tokens", sa.Integer(), False), ("min_version", sa.Integer(), True),
                ("max_version", sa.Integer(), True), ("dispatched_at", sa.Float(), True),
                ("finished_at", sa.Float(), True), ("generate_s", sa.Float(), True), ("train_step", sa.Integer(), True),
                ("teacher", ID, True), ("config_version", sa.Integer(), False), ("effort", sa.Integer(), True),
                ("seq", sa.Integer(), False)],
    "train_steps": [("run_id", ID, False), ("step", sa.Integer(), False), ("created_at", sa.Float(), False),
                    ("metrics_json", sa.Text(), False)],
    "trained": [("run_id", ID, False), ("sample_id", ID, False), ("step", sa.Integer(), False)],
    "config_versions": [("id", sa.Integer(), False), ("run_id", ID, False), ("version", sa.Integer(), True),
                        ("status", sa.String(16), False), ("patch_json", sa.Text(), False), ("reason", sa.Text(), True),
                        ("train_step", sa.Integer(), False), ("created_at", sa.Float(), False),
                        ("seq", sa.Integer(), False)],
    "restarts": [("id", sa.Integer(), False), ("run_id", ID, False), ("restarted_at", sa.Float(), False),
                 ("checkpoint", sa.Text(), False), ("train_step", sa.Integer(), False),
                 ("prompts_redispatched", sa.Integer(), False), ("samples_regenerated", sa.Integer(), False),
                 ("samples_untrained", sa.Integer(), False), ("train_steps_rolled_back", sa.Integer(), False)],
    "segments": [("id", sa.Integer(), False), ("sample_id", ID, False), ("start", sa.Integer(), False),
                 ("end", sa.Integer(), False), ("policy_version", sa.Integer(), False)],
}
PRIMARY_KEYS = {"runs": ["run_id"], "prompts": ["prompt_id"], "samples": ["sample_id"], "train_steps": ["run_id", "step"],
                "trained": ["run_id", "sample_id", "step"], "config_versions": ["id"], "restarts": ["id"],
                "segments": ["id"]}
INDEXES = {"prompts": ["run_id", "seq"],
           "samples": ["effort", "teacher", "train_step", "reward", "run_id", "prompt_id", "dataset", "seq"],
           "config_versions": ["run_id", "seq"], "restarts": ["run_id"], "segments": ["sample_id"]}
ADDED_LATER = {("samples", "effort"): "5aa29a3"}
"""Columns a store written before that commit lacks; adopting it adds them (nullable)."""


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    if inspector.has_table("samples"):
        _adopt_unversioned(inspector)
        return
    for table, columns in TABLES.items():
        constraints = [sa.PrimaryKeyConstraint(*PRIMARY_KEYS[table])]
        if table == "segments":
            constraints.append(sa.ForeignKeyConstraint(["sample_id"], ["samples.sample_id"]))
        # d07e8ae's composite keys held a step number that is never generated (autoincrement=False).
        auto = False if table in ("train_steps", "trained") else "auto"
        op.create_table(table, *(sa.Column(n, t, nullable=null, autoincrement=auto) for n, t, null in columns),
                        *constraints)
        for column in INDEXES.get(table, []):
            op.create_index(f"ix_{table}_{column}", table, [column])


def _adopt_unversioned(inspector) -> None:
    missing = []
    for table, columns in TABLES.items():
        have = {c["name"] for c in inspector.get_columns(table)} if inspector.has_table(table) else set()
        missing += [f"{table}.{n}" for n, _, _ in columns if n not in have and (table, n) not in ADDED_LATER]
    if missing:
        # An unversioned store older than the oldest layout this code adopts (or not a store at all).
        raise StoreError(f"an unversioned store without {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                         "is older than commit bde8a4c or not an asyncrl store; it cannot be upgraded")
    for (table, column), _commit in ADDED_LATER.items():
        if column not in {c["name"] for c in inspector.get_columns(table)}:
            op.add_column(table, sa.Column(column, dict((n, t) for n, t, _ in TABLES[table])[column], nullable=True))
            op.create_index(f"ix_{table}_{column}", table, [column])


def downgrade() -> None:
    raise NotImplementedError("the baseline is the oldest revision")

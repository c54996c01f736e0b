"""Alembic environment of the trajectory store, configured programmatically (no alembic.ini):
rl/store/db.py `upgrade_store` passes an open connection, already inside its transaction and holding
the migration lock, as `config.attributes["connection"]`. Offline (SQL script) mode is not used.

A new revision (a schema change in rl/store/schema.py) can be drafted from Python with
`alembic.command.revision(rl.store.db.alembic_config(conn), "message", autogenerate=True)`; check
its batch operations on SQLite by hand (tests/unit/test_store_migrations.py compares the result).
"""

from alembic import context

from rl.store.schema import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError("the trajectory store migrates through rl.store.db.upgrade_store (or `rl db upgrade`)")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
